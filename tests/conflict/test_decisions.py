"""Every decision of policies.py in full, as the user sees it: what is done,
the holder named, the reason and the holder's state a skip result, a refusal
or an error carries, and when a throttled call comes back (no servers)."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from celery_singleton_lock import DuplicateTaskError, LockBackendError
from celery_singleton_lock.conflict.policies import (
    Decision,
    Do,
    at_run,
    at_send,
    held_elsewhere,
    on_backend_error,
    other_key_taken,
)
from celery_singleton_lock.engine.replies import Acquire, Acquired, Enqueue, Enqueued
from celery_singleton_lock.process import Holder

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

H = "holder-id"


def shown(decision: Decision) -> dict[str, Any]:
    """A decision's fields, its error as (type, task, key, holder, state)."""
    error: Optional[tuple[Any, ...]] = None
    if isinstance(decision.error, DuplicateTaskError):
        e = decision.error
        error = (DuplicateTaskError, e.task, e.key, e.holder, e.state)
    elif decision.error is not None:
        error = (type(decision.error), str(decision.error))
    return {"do": decision.do, "holder": decision.holder, "reason": decision.reason,
            "state": decision.state, "keyed": decision.keyed,
            "reopens_in": decision.reopens_in, "error": error}


def expect(do: Do, holder: Optional[str] = H, reason: str = "", state: str = "",
           keyed: bool = False, reopens_in: Optional[float] = None,
           error: Optional[tuple[Any, ...]] = None) -> dict[str, Any]:
    return {"do": do, "holder": holder, "reason": reason, "state": state, "keyed": keyed,
            "reopens_in": reopens_in, "error": error}


def dup(state: str) -> tuple[Any, ...]:
    return (DuplicateTaskError, "t.x", "k", H, state)


RUNNING = Holder(H, exec_id="exec-1")  # its record names an execution: it started


def acquired(status: Acquire, accepted: bool = False, reopens_ms: int = 0,
             holder: Optional[Holder] = RUNNING) -> Acquired:
    return Acquired(status, holder=holder, queued_by_it=accepted, reopens_ms=reopens_ms)


RUN_TABLE = [
    # (status, policy, accepted, reopens_ms) -> the decision
    ((Acquire.GRANTED, "skip", False, 0), expect(Do.RUN, holder=None)),
    ((Acquire.REPLACED, "replace", False, 0), expect(Do.SKIP, reason="replaced",
                                                      state="queued")),
    ((Acquire.FINISHED, "skip", False, 0), expect(Do.DROP,
                                                   reason="this task id already finished")),
    ((Acquire.FINISHED, "raise", True, 0), expect(Do.DROP,
                                                   reason="this task id already finished")),
    ((Acquire.DONE, "retry", False, 0), expect(Do.SKIP, reason="done", state="done")),
    ((Acquire.DONE, "raise", True, 0), expect(Do.SKIP, reason="done", state="done")),
    ((Acquire.THROTTLED, "skip", False, 1250), expect(Do.SKIP, reason="throttled",
                                                       state="started", reopens_in=1.25)),
    ((Acquire.THROTTLED, "replace", False, 500), expect(Do.SKIP, reason="throttled",
                                                         state="started", reopens_in=0.5)),
    ((Acquire.THROTTLED, "retry", True, 2000), expect(Do.WAIT, reason="throttled",
                                                       state="started", reopens_in=2.0)),
    ((Acquire.THROTTLED, "raise", False, 1), expect(Do.FAIL, reason="throttled",
                                                     state="started", reopens_in=0.001,
                                                     error=dup("started"))),
    ((Acquire.RATE_LIMITED, "skip", False, 1250), expect(Do.SKIP, reason="rate limited",
                                                          state="started", reopens_in=1.25)),
    ((Acquire.RATE_LIMITED, "replace", False, 500), expect(Do.SKIP, reason="rate limited",
                                                            state="started", reopens_in=0.5)),
    ((Acquire.RATE_LIMITED, "retry", True, 2000), expect(Do.WAIT, reason="rate limited",
                                                          state="started", reopens_in=2.0)),
    ((Acquire.RATE_LIMITED, "raise", False, 1), expect(Do.FAIL, reason="rate limited",
                                                        state="started", reopens_in=0.001,
                                                        error=dup("started"))),
    ((Acquire.SAME_TASK, "skip", False, 0), expect(Do.WAIT_QUIETLY,
                                                    reason="its running original")),
    ((Acquire.SAME_TASK, "raise", True, 0), expect(Do.WAIT_QUIETLY,
                                                    reason="its running original")),
    ((Acquire.HELD, "raise", True, 0), expect(Do.WAIT,
                                              reason="accepted when sent; waits its turn")),
    ((Acquire.HELD, "skip", False, 0), expect(Do.SKIP, reason="duplicate", state="running")),
    ((Acquire.HELD, "replace", False, 0), expect(Do.SKIP, reason="duplicate",
                                                  state="running")),
    ((Acquire.HELD, "retry", False, 0), expect(Do.WAIT, reason="duplicate", state="running")),
    ((Acquire.HELD, "raise", False, 0), expect(Do.FAIL, reason="duplicate", state="running",
                                               error=dup("running"))),
]


@pytest.mark.parametrize("given,decided", RUN_TABLE,
                         ids=[f"{s.name}-{p}{'-accepted' if a else ''}"
                              for (s, p, a, _), _d in RUN_TABLE])
def test_at_run(given, decided):
    status, policy, accepted, reopens_ms = given
    answer = acquired(status, accepted, reopens_ms,
                      holder=None if status is Acquire.GRANTED else RUNNING)
    assert shown(at_run(answer, on_duplicate=policy, task_name="t.x", key="k")) == decided


def test_a_held_key_whose_holder_never_started_is_queued():
    """A record naming no execution: the holder took the key when sent."""
    answer = acquired(Acquire.HELD, holder=Holder(H, exec_id=""))
    assert shown(at_run(answer, on_duplicate="skip", task_name="t.x", key="k")) == expect(
        Do.SKIP, reason="duplicate", state="queued")


@pytest.mark.parametrize("policy", ["skip", "replace", "retry", "raise"])
def test_a_holder_not_renewed_on_time_is_waited_for_whatever_the_policy(policy):
    """A holder whose lock lives less than two thirds of its lease may not run:
    the execution waits until that lock is renewed or gone, the holder's
    state as it is (running, or queued when its record names no execution)."""
    doubtful = Acquired(Acquire.HELD, holder=RUNNING, ttl_ms=1500, lease_ms=30_000)
    assert shown(at_run(doubtful, on_duplicate=policy, task_name="t.x", key="k")) == expect(
        Do.WAIT, reason="its holder's lock is not renewed on time", state="running",
        reopens_in=1.5)
    queued = Acquired(Acquire.HELD, holder=Holder(H, exec_id=""), ttl_ms=250, lease_ms=30_000)
    assert shown(at_run(queued, on_duplicate=policy, task_name="t.x", key="k")) == expect(
        Do.WAIT, reason="its holder's lock is not renewed on time", state="queued",
        reopens_in=0.25)


def enqueued(status: Enqueue, running: bool = False) -> Enqueued:
    return Enqueued(status, holder=None if status is Enqueue.TAKEN else Holder(H),
                    running=running)


SEND_TABLE = [
    # (status, running, policy, in a canvas) -> the decision
    ((Enqueue.TAKEN, False, "raise", False), expect(Do.SEND, holder=None, keyed=True)),
    ((Enqueue.REPLACED, False, "replace", False), expect(Do.SEND, reason="replaces",
                                                          keyed=True)),
    ((Enqueue.HELD, False, "raise", True), expect(Do.SEND, reason="canvas member")),
    ((Enqueue.DONE, False, "raise", True), expect(Do.SEND, reason="canvas member")),
    ((Enqueue.DONE, False, "retry", False), expect(Do.REFUSE, reason="done", state="done")),
    ((Enqueue.DONE, False, "raise", False), expect(Do.REFUSE, reason="done", state="done")),
    ((Enqueue.HELD, False, "raise", False), expect(Do.FAIL, reason="duplicate",
                                                    state="queued", error=dup("queued"))),
    ((Enqueue.HELD, True, "raise", False), expect(Do.FAIL, reason="duplicate",
                                                   state="running", error=dup("running"))),
    ((Enqueue.HELD, False, "skip", False), expect(Do.REFUSE, reason="duplicate",
                                                   state="queued")),
    ((Enqueue.HELD, True, "replace", False), expect(Do.REFUSE, reason="duplicate",
                                                     state="running")),
    ((Enqueue.HELD, True, "retry", False), expect(Do.SEND, reason="waits when it starts")),
]


@pytest.mark.parametrize("given,decided", SEND_TABLE,
                         ids=[f"{s.name}-{p}{'-running' if r else ''}{'-canvas' if c else ''}"
                              for (s, r, p, c), _d in SEND_TABLE])
def test_at_send(given, decided):
    status, running, policy, in_canvas = given
    answer = enqueued(status, running)
    assert shown(at_send(answer, on_duplicate=policy, task_name="t.x", key="k",
                         in_canvas=in_canvas)) == decided


def test_a_replacing_send_without_a_holder_names_none():
    answer = Enqueued(Enqueue.REPLACED)
    assert shown(at_send(answer, on_duplicate="replace", task_name="t.x", key="k",
                         in_canvas=False)) == expect(Do.SEND, holder=None, reason="replaces",
                                                     keyed=True)


BACKEND_TABLE = [
    (("raise", "send"), expect(Do.FAIL, holder=None, reason="backend",
                               error=(LockBackendError, str(LockBackendError(
                                   "k", "ConnectionError: down"))))),
    (("raise", "run"), expect(Do.FAIL, holder=None, reason="backend",
                              error=(LockBackendError, str(LockBackendError(
                                  "k", "ConnectionError: down"))))),
    (("retry", "send"), expect(Do.SEND, holder=None, reason="lock backend unavailable")),
    (("run", "send"), expect(Do.SEND, holder=None, reason="lock backend unavailable")),
    (("run", "run"), expect(Do.RUN_UNLOCKED, holder=None, reason="lock backend unavailable")),
    (("retry", "run"), expect(Do.WAIT, holder=None,
                              reason="lock backend unavailable: ConnectionError: down")),
]


@pytest.mark.parametrize("given,decided", BACKEND_TABLE,
                         ids=[f"{p}-at-{ph}" for (p, ph), _d in BACKEND_TABLE])
def test_on_backend_error(given, decided):
    policy, phase = given
    assert shown(on_backend_error(policy, phase=phase, key="k",
                                  error=ConnectionError("down"))) == decided


# singleton_also_lock: the old library's key of the call is taken

@pytest.mark.parametrize("policy,decided", [
    ("skip", expect(Do.REFUSE, reason="duplicate", state="queued")),
    ("replace", expect(Do.REFUSE, reason="duplicate", state="queued")),
    ("retry", expect(Do.REFUSE, reason="duplicate", state="queued")),
    ("raise", expect(Do.FAIL, reason="duplicate", state="queued", error=dup("queued"))),
])
def test_a_send_whose_old_key_is_taken_is_refused_or_raises(policy, decided):
    assert shown(other_key_taken(policy, H, task_name="t.x", key="k")) == decided


@pytest.mark.parametrize("policy,decided", [
    ("skip", expect(Do.SKIP, reason="duplicate", state="running")),
    ("replace", expect(Do.SKIP, reason="duplicate", state="running")),
    ("retry", expect(Do.WAIT, reason="duplicate", state="running")),
    ("raise", expect(Do.FAIL, reason="duplicate", state="running", error=dup("running"))),
])
def test_a_run_whose_old_key_is_held_is_a_duplicate_of_a_running_one(policy, decided):
    assert shown(held_elsewhere(policy, H, task_name="t.x", key="k")) == decided
