"""A reply no script gives: the error names the script and quotes the reply
as it came; the owner record as Redis stores it, bytes and all (no servers)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from celery_singleton_lock import UnexpectedReplyError
from celery_singleton_lock.engine.replies import (
    LATE,
    Acquire,
    acquired,
    enqueued,
    flag,
    reclaimed,
    record,
    released,
    renewed,
)
from celery_singleton_lock.exceptions import LateRequestError

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def owner_record(task: str = "task", pid: str = "42", host: str = "w1@h") -> str:
    return "\n".join(["exec", "", "", "7", "1795000000123456", "5000", "60000", "0", pid,
                      "host:1", host, "t.name", task])


@pytest.mark.parametrize("script,read,reply,quoted", [
    ("acquire", acquired, "not-a-token", "'not-a-token'"),
    ("acquire", acquired, [], "[]"),
    ("acquire", acquired, None, "None"),
    ("acquire", acquired, ["x", "y"], "'x'"),
    ("acquire", acquired, [9, "y"], "9"),
    ("acquire", acquired, [1, "not-a-token"], "[1, 'not-a-token']"),
    ("acquire", acquired, [5, "t"], "[5, 't']"),
    ("reclaim", reclaimed, [7, "x"], "[7, 'x']"),
    ("reclaim", reclaimed, [7, owner_record()], repr([7, owner_record()])),
    ("reclaim", reclaimed, "not-a-token", "'not-a-token'"),
    ("enqueue", enqueued, [], "[]"),
    ("enqueue", enqueued, [3, "x"], "3"),
    ("enqueue", enqueued, [2, "x", "soon"], "[2, 'x', 'soon']"),
    ("release", released, 5, "5"),
    ("release", released, "gone", "'gone'"),
    ("renew", lambda r: renewed(r, 2), [1], "[1]"),
    ("renew", lambda r: renewed(r, 2), [1, 9], "9"),
    ("handoff", lambda r: flag(r, "handoff"), 2, "2"),
    ("owner record", record, "exec\nonly", "'exec\\nonly'"),
])
def test_a_reply_no_script_gives_names_the_script_and_quotes_the_reply(
        script: str, read: Callable[[Any], Any], reply: Any, quoted: str) -> None:
    with pytest.raises(UnexpectedReplyError) as info:
        read(reply)
    assert str(info.value) == f"script {script!r} gave a reply it never gives: {quoted}"


def test_an_owner_record_in_bytes_keeps_what_is_not_utf_8() -> None:
    raw = owner_record(host="w\xe9@h").encode("latin-1")  # a host name in another encoding
    fields = record(raw)
    assert fields["host"].encode("utf-8", "surrogateescape") == b"w\xe9@h"
    assert fields["task"] == "task" and fields["at"] == "1795000000123"
    assert record(b"") == {} and record(None) == {}


def test_a_holder_without_a_pid_has_pid_0() -> None:
    answer = acquired([0, owner_record(pid=""), 0])
    assert answer.status is Acquire.HELD
    assert (answer.holder.task_id, answer.holder.pid) == ("task", 0)


@pytest.mark.parametrize("script,read", [
    ("acquire", acquired), ("enqueue", enqueued), ("reclaim", reclaimed),
])
def test_a_request_that_came_after_its_deadline_raises_with_the_servers_clock(
        script: str, read: Callable[[Any], Any]) -> None:
    """``{8, server clock ms}`` (``too_late`` in lua/_record.lua): refused,
    nothing written; the error carries the server's clock, no deadline."""
    assert LATE == 8
    with pytest.raises(LateRequestError) as info:
        read([8, 1795000000123])
    assert (info.value.script, info.value.server_ms, info.value.deadline_ms) == (
        script, 1795000000123, 0)
    assert str(info.value) == (f"the {script} request reached the lock Redis after its "
                               "caller's deadline: refused, nothing done")


@pytest.mark.parametrize("script,read,reply,quoted", [
    ("acquire", acquired, [8, "1795000000123"], "8"),
    ("acquire", acquired, [8], "8"),
    ("acquire", acquired, [8, 1795000000123, 1], "8"),
    ("enqueue", enqueued, [8, "soon"], "8"),
    ("enqueue", enqueued, [8, 1, 2], "8"),
    ("reclaim", reclaimed, [8, "soon"], "[8, 'soon']"),
    ("reclaim", reclaimed, [8], "[8]"),
])
def test_a_late_reply_of_another_shape_is_no_late_request(
        script: str, read: Callable[[Any], Any], reply: Any, quoted: str) -> None:
    with pytest.raises(UnexpectedReplyError) as info:
        read(reply)
    assert str(info.value) == f"script {script!r} gave a reply it never gives: {quoted}"
