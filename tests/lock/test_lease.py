"""The lease on the local monotonic clock, with the clock faked (no servers)."""

from __future__ import annotations

import pytest

from celery_singleton_lock import LockLostError
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held(clock: Clock, lease: float = 30.0) -> SingletonLock:
    return SingletonLock(LockKeys("singleton:", "0" * 32), task_id="t", exec_id="e", token=5,
                         lease=lease, started=clock(), held=True, clock=clock)


def test_a_lease_holds_until_its_deadline_then_is_lost():
    clock = Clock()
    lock = held(clock)
    clock.now += 29.9
    assert not lock.lost and not lock.expired
    lock.check()
    clock.now += 0.2
    assert lock.expired and lock.lost
    with pytest.raises(LockLostError, match="token 5"):
        lock.check()


def test_a_renewal_counts_from_when_it_was_sent():
    clock = Clock()
    lock = held(clock)
    clock.now += 10
    lock.renewed(sent_at=clock())
    clock.now += 29
    assert not lock.lost
    clock.now += 2
    assert lock.lost


def test_lost_is_for_good():
    clock = Clock()
    lock = held(clock)
    lock.mark_lost("taken over")
    lock.renewed(sent_at=clock())
    assert lock.lost
    with pytest.raises(LockLostError, match="taken over"):
        lock.check()


def test_an_unlocked_handle_never_expires():
    clock = Clock()
    lock = SingletonLock(LockKeys("singleton:", "0" * 32), clock=clock)
    clock.now += 10**9
    assert not lock.lost and lock.token == 0


def test_a_redlock_holder_counts_its_lease_short_by_the_drift_allowed():
    """Redlock allows the masters' clocks 1 % of the lease plus 2 ms of drift:
    the holder's deadline comes that much early, at grant and after renewals."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.redlock.engine import RedlockEngine

    engine = RedlockEngine.from_config(SingletonConfig.defaults(
        "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0"))  # nothing is connected
    margin = engine.lease_margin(30.0)
    assert margin == pytest.approx(0.302)
    clock = Clock()
    lock = SingletonLock(LockKeys("singleton:", "0" * 32), task_id="t", exec_id="e", token=5,
                         lease=30.0, started=clock(), held=True, margin=margin, clock=clock)
    clock.now += 29.65
    assert not lock.expired
    clock.now += 0.06  # 29.71 s: past 30 - 0.302
    assert lock.expired and lock.lost
    lock = SingletonLock(LockKeys("singleton:", "0" * 32), task_id="t", exec_id="e", token=5,
                         lease=30.0, started=clock(), held=True, margin=margin, clock=clock)
    clock.now += 10
    lock.renewed(sent_at=clock())
    clock.now += 29.6
    assert not lock.lost
    clock.now += 0.1
    assert lock.lost
