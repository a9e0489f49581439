"""What a conflict gets: every rule of policies.py, no servers."""

from __future__ import annotations

import pytest

from celery_singleton_lock import DuplicateTaskError, LockBackendError, SingletonConfig
from celery_singleton_lock.conflict.policies import Do, at_run, at_send, backoff, on_backend_error
from celery_singleton_lock.engine.replies import Acquire, Acquired, Enqueue, Enqueued
from celery_singleton_lock.process import Holder

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

HOLDER = Holder("holder-id")


def run(status: Acquire, on_duplicate: str = "skip", accepted: bool = False) -> object:
    answer = Acquired(status, token=7 if status is Acquire.GRANTED else 0,
                      holder=None if status is Acquire.GRANTED else HOLDER,
                      queued_by_it=accepted)
    return at_run(answer, on_duplicate=on_duplicate, task_name="t.x", key="k")


def test_a_grant_runs():
    assert run(Acquire.GRANTED).do is Do.RUN


@pytest.mark.parametrize("policy,do", [("skip", Do.SKIP), ("retry", Do.WAIT),
                                       ("raise", Do.FAIL)])
def test_a_held_key_gets_the_duplicate_policy(policy, do):
    decision = run(Acquire.HELD, policy)
    assert decision.do is do and decision.holder == "holder-id"
    if do is Do.FAIL:
        assert isinstance(decision.error, DuplicateTaskError)
        assert "holder-id" in str(decision.error)


@pytest.mark.parametrize("policy", ["skip", "retry", "raise"])
def test_a_send_that_was_accepted_waits_whatever_the_policy(policy):
    """Accepted at send (it took the queued key): it must run, so it waits."""
    assert run(Acquire.HELD, policy, accepted=True).do is Do.WAIT


@pytest.mark.parametrize("policy", ["skip", "retry", "raise", "replace"])
def test_a_holder_not_renewed_on_time_is_waited_for_whatever_the_policy(policy):
    """Its lock lives less than two thirds of its lease: the holder may not be
    running (a grant never confirmed, a holder cut off, a release on its way),
    so the execution is not its duplicate yet: it comes back when the lock
    is decided (what the lock has left), and is neither skipped nor failed."""
    doubtful = Acquired(Acquire.HELD, holder=Holder("holder-id"), ttl_ms=1500, lease_ms=30_000)
    decision = at_run(doubtful, on_duplicate=policy, task_name="t", key="k")
    assert decision.do is Do.WAIT and decision.holder == "holder-id"
    assert decision.reopens_in == 1.5
    on_time = Acquired(Acquire.HELD, holder=Holder("holder-id"), ttl_ms=25_000,
                       lease_ms=30_000)
    assert at_run(on_time, on_duplicate="skip", task_name="t", key="k").do is Do.SKIP


@pytest.mark.parametrize("policy", ["skip", "retry", "raise"])
def test_within_the_done_window_every_duplicate_is_skipped(policy):
    decision = run(Acquire.DONE, policy)
    assert decision.do is Do.SKIP and decision.reason == "done"


def test_a_redelivered_copy_waits_quietly_and_a_late_one_is_dropped():
    assert run(Acquire.SAME_TASK, "skip").do is Do.WAIT_QUIETLY
    assert run(Acquire.FINISHED, "retry").do is Do.DROP


def send(status: Enqueue, on_duplicate: str = "skip", in_canvas: bool = False) -> object:
    answer = Enqueued(status, holder=None if status is Enqueue.TAKEN else HOLDER)
    return at_send(answer, on_duplicate=on_duplicate, task_name="t.x", key="k",
                   in_canvas=in_canvas)


def test_a_send_that_takes_its_key_is_sent_keyed():
    decision = send(Enqueue.TAKEN)
    assert decision.do is Do.SEND and decision.keyed


@pytest.mark.parametrize("status,policy,do,reason", [
    (Enqueue.HELD, "skip", Do.REFUSE, "duplicate"),
    (Enqueue.HELD, "retry", Do.SEND, "waits when it starts"),
    (Enqueue.HELD, "raise", Do.FAIL, "duplicate"),
    (Enqueue.DONE, "raise", Do.REFUSE, "done"),
    (Enqueue.DONE, "retry", Do.REFUSE, "done"),
])
def test_a_send_refused_at_send_time(status, policy, do, reason):
    decision = send(status, policy)
    assert (decision.do, decision.reason, decision.keyed) == (do, reason, False)


@pytest.mark.parametrize("status", [Enqueue.HELD, Enqueue.DONE])
def test_a_canvas_member_is_never_refused_at_send(status):
    assert send(status, "raise", in_canvas=True).do is Do.SEND


@pytest.mark.parametrize("policy,phase,do", [
    ("retry", "run", Do.WAIT), ("run", "run", Do.RUN_UNLOCKED), ("raise", "run", Do.FAIL),
    ("retry", "send", Do.SEND), ("run", "send", Do.SEND), ("raise", "send", Do.FAIL),
])
def test_redis_down_is_a_policy_never_a_silent_drop(policy, phase, do):
    decision = on_backend_error(policy, phase=phase, key="k", error=ConnectionError("down"))
    assert decision.do is do
    if do is Do.FAIL:
        assert isinstance(decision.error, LockBackendError)
        assert "down" in str(decision.error)


def test_backoff_doubles_up_to_its_ceiling_with_jitter():
    config = SingletonConfig.defaults("redis://h/0", retry_delay=1.0, retry_max_delay=8.0)
    assert 0.8 <= backoff(config, 0) <= 1.2
    assert 3.2 <= backoff(config, 2) <= 4.8
    assert all(6.4 <= backoff(config, n) <= 9.6 for n in (3, 10, 100))
    # the jitter is within a fifth either way of the doubled delay, each time
    assert all(0.8 <= backoff(config, 0) <= 1.2 for _ in range(300))


def test_waiting_for_the_lock_redis_never_backs_off_past_twice_the_delay():
    """A task waiting out an outage is tried again within 2 x retry_delay, each
    try on its own moment: once Redis answers, every one runs within that."""
    config = SingletonConfig.defaults("redis://h/0", retry_delay=1.0, retry_max_delay=30.0)
    first = [backoff(config, 0, backend_error=True) for _ in range(200)]
    later = [backoff(config, n, backend_error=True) for n in (1, 5, 50) for _ in range(100)]
    assert all(0.5 <= d <= 1.0 for d in first)
    assert all(1.0 <= d <= 2.0 for d in later)
    assert len({round(d, 3) for d in later}) > 50  # spread, not all at one moment
