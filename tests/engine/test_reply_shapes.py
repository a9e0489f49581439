"""Each script reply read field by field, every shape each script gives, and
the owner record's layout (docs/redis-keys.md); anything else raises (no servers)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_singleton_lock import UnexpectedReplyError
from celery_singleton_lock.engine.replies import (
    RECORD_FIELDS,
    Acquire,
    Acquired,
    Enqueue,
    Enqueued,
    Reclaim,
    Reclaimed,
    Release,
    Released,
    Renew,
    acquired,
    enqueued,
    flag,
    lease_of,
    reclaimed,
    record,
    released,
    renewed,
)
from celery_singleton_lock.process import Holder

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

#: exec, handoff, copies, token, at (µs), lease, fin, retries, pid, hostkey, host, name, task
RAW = "\n".join(["exec-1", "", "", "17", "1795000000123456", "5000", "60000", "2", "4242",
                 "boot:4026531836", "w1@h", "t.name", "task\nwith a newline"])
HOLDER = Holder(task_id="task\nwith a newline", exec_id="exec-1", host_key="boot:4026531836",
                pid=4242, hostname="w1@h")


def test_the_owner_record_reads_as_named_fields_with_at_in_ms():
    assert RECORD_FIELDS == ("exec", "handoff", "copies", "token", "at", "lease", "fin",
                             "retries", "pid", "hostkey", "host", "name", "task")
    expected = {"exec": "exec-1", "token": "17", "at": "1795000000123", "lease": "5000",
                "fin": "60000", "retries": "2", "pid": "4242", "hostkey": "boot:4026531836",
                "host": "w1@h", "name": "t.name", "task": "task\nwith a newline"}
    assert record(RAW) == expected
    assert record(RAW.encode()) == expected
    # handoff and copies appear only when set; other empty fields are kept
    handed = RAW.replace("exec-1\n\n\n", "exec-1\n3\n1\n").replace("\nw1@h\n", "\n\n")
    assert record(handed) == {**expected, "handoff": "3", "copies": "1", "host": ""}
    assert record(RAW.replace("\n1795000000123456\n", "\n999\n"))["at"] == "0"
    assert record(RAW.replace("\n1795000000123456\n", "\n\n"))["at"] == ""
    assert record(None) == {} and record("") == {} and record(b"") == {}


@pytest.mark.parametrize("raw", ["exec\nonly\nsix\nfields\nhere\n!", "\n".join("x" * 12)])
def test_an_owner_record_of_another_shape_raises(raw):
    with pytest.raises(UnexpectedReplyError):
        record(raw)


@pytest.mark.parametrize("reply,answer", [
    ("1795000000000001", Acquired(Acquire.GRANTED, token=1795000000000001)),
    ([1, "1795000000000002", 3], Acquired(Acquire.GRANTED, token=1795000000000002, slot=3)),
    ([1, "1795000000000003"], Acquired(Acquire.GRANTED, token=1795000000000003, slot=1)),
    ([0, RAW, 0, 29000], Acquired(Acquire.HELD, holder=HOLDER, ttl_ms=29000, lease_ms=5000)),
    ([0, RAW, 1], Acquired(Acquire.HELD, holder=HOLDER, queued_by_it=True, lease_ms=5000)),
    ([0, RAW], Acquired(Acquire.HELD, holder=HOLDER, lease_ms=5000)),
    ([0, RAW, 0, 2, 800], Acquired(Acquire.HELD, holder=HOLDER, slot=2, ttl_ms=800,
                                   lease_ms=5000)),
    ([2, RAW], Acquired(Acquire.SAME_TASK, holder=HOLDER)),
    ([2, RAW, 3], Acquired(Acquire.SAME_TASK, holder=HOLDER, slot=3)),
    ([3, "t1"], Acquired(Acquire.FINISHED, holder=Holder("t1"))),
    ([4, "t2"], Acquired(Acquire.DONE, holder=Holder("t2"))),
    ([6, "t3"], Acquired(Acquire.REPLACED, holder=Holder("t3"))),
    ([5, "t4", 1500], Acquired(Acquire.THROTTLED, holder=Holder("t4"), reopens_ms=1500)),
    ([5, "t4", -3], Acquired(Acquire.THROTTLED, holder=Holder("t4"), reopens_ms=0)),
], ids=["token", "slot-token", "slot-token-no-slot", "held", "held-accepted", "held-short",
        "held-slot", "same-task", "same-task-slot", "finished", "done", "replaced",
        "throttled", "throttled-reopened"])
def test_acquire_replies(reply: Any, answer: Acquired):
    assert acquired(reply) == answer


@pytest.mark.parametrize("ttl,lease,budget,doubtful,unconfirmed", [
    (1500, 30_000, 2000, True, True),      # a grant not confirmed yet
    (25_000, 30_000, 2000, False, False),  # renewed on time: its holder runs
    (3999, 30_000, 2000, True, True),      # ... decided within two waits
    (4000, 30_000, 2000, True, False),     # not renewed for a while: doubtful, for longer
    (19_999, 30_000, 2000, True, False),
    (20_000, 30_000, 2000, False, False),  # two thirds of its lease left: on time
    (-1, 30_000, 2000, False, False),      # no TTL read (a send-time key's holder)
    (900, 1000, 2000, False, False),       # a short lease, fresh as granted
    (600, 1000, 2000, True, True),         # ... and past a third of it unrenewed
    (1500, 0, 2000, False, False),         # no lease known (an older record, a hand-off)
])
def test_a_refusal_by_a_holder_not_renewed_on_time(ttl: int, lease: int, budget: int,
                                                  doubtful: bool, unconfirmed: bool):
    """A holder's lock living less than two thirds of its lease was not renewed
    on time: the holder may not run (a grant not confirmed, a holder cut off,
    a release on its way), and the refused execution waits for it instead of
    being skipped; within twice a caller's wait it is looked at again at once."""
    answer = Acquired(Acquire.HELD, holder=HOLDER, ttl_ms=ttl, lease_ms=lease)
    assert answer.doubtful is doubtful
    assert answer.unconfirmed(budget) is unconfirmed
    copy = Acquired(Acquire.SAME_TASK, holder=HOLDER, ttl_ms=ttl, lease_ms=lease)
    assert copy.doubtful is False and copy.unconfirmed(budget) is False


@pytest.mark.parametrize("reply", ["not-a-token", [], None, 7, [9, "x"], [1], [1, "x"],
                                   [0], [0, 42], [5, "t"], [5, "t", "soon"], [2, RAW, "x"],
                                   [0, RAW, 0, "x"], [0, "too\nfew"]])
def test_an_acquire_reply_of_another_shape_raises(reply):
    with pytest.raises(UnexpectedReplyError, match="acquire"):
        acquired(reply)


@pytest.mark.parametrize("reply,answer", [
    ("1795000000000009", Reclaimed(Reclaim.WRITTEN_BACK, token=1795000000000009)),
    (-1, Reclaimed(Reclaim.RELEASED)),
    ([1, "1795000000000010"], Reclaimed(Reclaim.OURS, token=1795000000000010)),
    ([0, RAW], Reclaimed(Reclaim.HELD, holder=HOLDER)),
])
def test_reclaim_replies(reply: Any, answer: Reclaimed):
    assert reclaimed(reply) == answer


@pytest.mark.parametrize("reply", ["x", 1, 0, None, [], [1], [1, "x"], [0], [0, 5], [2, "1"],
                                   [-1]])
def test_a_reclaim_reply_of_another_shape_raises(reply):
    with pytest.raises(UnexpectedReplyError, match="reclaim"):
        reclaimed(reply)


@pytest.mark.parametrize("reply,answer", [
    ([1], Enqueued(Enqueue.TAKEN)),
    ([1, 2500], Enqueued(Enqueue.TAKEN, countdown_ms=2500)),
    ([2, "old", 3000], Enqueued(Enqueue.REPLACED, holder=Holder("old"), countdown_ms=3000)),
    ([2, "old", 3000, "older", "oldest"],
     Enqueued(Enqueue.REPLACED, holder=Holder("old"), countdown_ms=3000,
              superseded=("older", "oldest"))),
    ([0, "q1"], Enqueued(Enqueue.HELD, holder=Holder("q1"))),
    ([0, "q1", 0], Enqueued(Enqueue.HELD, holder=Holder("q1"))),
    ([0, "q1", 1], Enqueued(Enqueue.HELD, holder=Holder("q1"), running=True)),
    ([4, "d1"], Enqueued(Enqueue.DONE, holder=Holder("d1"))),
])
def test_enqueue_replies(reply: Any, answer: Enqueued):
    assert enqueued(reply) == answer


def test_enqueue_states():
    assert Enqueued(Enqueue.DONE, holder=Holder("d")).holder_state == "done"
    assert Enqueued(Enqueue.HELD, holder=Holder("q"), running=True).holder_state == "running"
    assert Enqueued(Enqueue.HELD, holder=Holder("q")).holder_state == "queued"


@pytest.mark.parametrize("reply", [None, [], 1, [3, "x"], [1, "soon"], [2, "old"],
                                   [2, "old", "x"], [0]])
def test_an_enqueue_reply_of_another_shape_raises(reply):
    with pytest.raises(UnexpectedReplyError, match="enqueue"):
        enqueued(reply)


def test_release_replies():
    assert released(1) == Released(Release.RELEASED, False)
    assert released(0) == Released(Release.TAKEN, False)
    assert released(-1, repeated=True) == Released(Release.FREE, True)
    assert released("1") == Released(Release.RELEASED, False)  # a reply through RESP3 paths
    assert released(True) == Released(Release.RELEASED, False)
    for bad in (2, "x", None, [1]):
        with pytest.raises(UnexpectedReplyError, match="release"):
            released(bad)


def test_renew_replies_one_per_lock():
    assert renewed([1, 0, 2, 3], 4) == [Renew.RENEWED, Renew.NOT_OURS, Renew.HANDED_OFF,
                                        Renew.ABSENT]
    assert renewed([], 0) == []
    for bad, count in (([1, 1], 3), (1, 1), (None, 0), ([1, 9], 2), ([1, "x"], 2)):
        with pytest.raises(UnexpectedReplyError, match="renew"):
            renewed(bad, count)


def test_yes_no_replies():
    assert flag(1, "handoff") is True and flag(0, "unqueue") is False
    for bad in (2, -1, None, "1"):
        with pytest.raises(UnexpectedReplyError, match="handoff"):
            flag(bad, "handoff")


def test_the_lease_of_a_holder_is_known_only_from_a_grants_record():
    """A refusal carries the lease its holder was granted (``lease``, ms); a
    record kept for a retry (``handoff`` set) lives the retry's wait, not a
    lease, and a record without a lease gives 0: not known."""
    assert lease_of(RAW) == 5000
    handed = RAW.replace("exec-1\n\n\n", "exec-1\n3\n\n")
    assert lease_of(handed) == 0
    assert acquired([0, handed, 0, 2500]) == Acquired(
        Acquire.HELD, holder=HOLDER, ttl_ms=2500, lease_ms=0)
    copies_only = RAW.replace("exec-1\n\n\n", "exec-1\n\n2\n")
    assert lease_of(copies_only) == 5000, "copies alone leave the lease known"
    no_lease = RAW.replace("\n5000\n", "\n\n")
    assert lease_of(no_lease) == 0
    assert acquired([0, no_lease, 0, 2500]).lease_ms == 0
    assert lease_of(RAW.replace("\n5000\n", "\n-5\n")) == 0
    # fewer than seven fields: not a grant's record
    for short in ("exec-1\n\nx", "exec-1\n3", "\n".join(["e", "", "", "1", "2", "5000"])):
        assert lease_of(short) == 0, short
    assert lease_of("\n".join(["e", "", "", "1", "2", "5000", "6"])) == 5000
