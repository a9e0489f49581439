"""Every script reply is named in one place; an unknown reply raises (no servers)."""

from __future__ import annotations

import pytest

from celery_singleton_lock import UnexpectedReplyError
from celery_singleton_lock.engine.replies import (
    Acquire,
    Enqueue,
    Release,
    Renew,
    acquired,
    enqueued,
    flag,
    released,
    renewed,
)

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def test_the_families_never_share_a_meaning():
    """HELD, TAKEN and RELEASED were once bare ints equal across families."""
    assert Acquire.HELD is not Release.TAKEN
    assert Acquire.GRANTED is not Release.RELEASED
    assert Acquire(0) is Acquire.HELD and Release(0) is Release.TAKEN


def owner_record(task: str, exec_id: str, pid: int, host: str) -> str:
    """The owner record acquire.lua writes and answers with (docs/redis-keys.md)."""
    return "\n".join([exec_id, "", "", "1795000000000000", "1795000000000000", "5000", "60000",
                      "0", str(pid), "host:1", host, "t.name", task])


def test_acquire_replies():
    grant = acquired("1795000000000000")
    assert grant.status is Acquire.GRANTED and grant.token == 1795000000000000
    held = acquired([0, owner_record("task", "exec", 42, "w1@h"), 1])
    assert held.status is Acquire.HELD and held.queued_by_it
    assert (held.holder.task_id, held.holder.pid, held.holder.hostname) == ("task", 42, "w1@h")
    assert held.holder.exec_id == "exec" and held.holder.host_key == "host:1"
    odd = acquired([0, owner_record("a\nb", "e", 0, "h"), 0])
    assert odd.holder.task_id == "a\nb" and not odd.queued_by_it, "the task id comes last"
    assert acquired([2, owner_record("t", "e", 0, "")]).status is Acquire.SAME_TASK
    assert acquired([3, "t"]).status is Acquire.FINISHED
    done = acquired([4, "winner"])
    assert done.status is Acquire.DONE and done.holder.task_id == "winner"


def test_other_families():
    assert enqueued([1]).status is Enqueue.TAKEN
    assert enqueued([0, "q1"]).holder.task_id == "q1"
    assert enqueued([4, "d"]).status is Enqueue.DONE


def test_what_the_holder_is_doing():
    """queued (took the key at send, not started), running, or done."""
    assert enqueued([0, "q1"]).holder_state == "queued"
    assert enqueued([0, "r1", 1]).holder_state == "running"
    assert enqueued([4, "d"]).holder_state == "done"
    assert acquired([0, owner_record("t", "exec", 1, "h"), 0]).holder_state == "running"
    # acquire.lua's answer for a key queued by another under queue_and_run: no execution
    assert acquired([0, "\n" * 12 + "q", 0]).holder_state == "queued"
    assert acquired([4, "winner"]).holder_state == "done"
    assert released(-1, repeated=True).status is Release.FREE
    assert renewed([1, 0, 2], 3) == [Renew.RENEWED, Renew.NOT_OURS, Renew.HANDED_OFF]
    assert flag(1, "handoff") is True and flag(0, "unqueue") is False


@pytest.mark.parametrize("parse,reply", [
    (acquired, [9, "x"]), (acquired, []), (acquired, "OK"), (acquired, [0, "only-task"]),
    (enqueued, [2]), (enqueued, [0]), (released, 5), (released, None),
    (lambda r: renewed(r, 2), [1]), (lambda r: renewed(r, 1), [7]),
    (lambda r: flag(r, "handoff"), 2),
])
def test_an_unknown_reply_raises_naming_the_script(parse, reply):
    with pytest.raises(UnexpectedReplyError, match="gave a reply it never gives"):
        parse(reply)
