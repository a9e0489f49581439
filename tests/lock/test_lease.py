"""The lease on the local monotonic clock, with the clock faked (no servers)."""

from __future__ import annotations

import re

import pytest

from celery_singleton_lock import LockLostError
from celery_singleton_lock.engine.replies import Confirmation, Release, Released, Renew
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


def unconfirmed(clock: Clock, window: float = 4.0, lease: float = 30.0,
                margin: float = 0.0) -> tuple[SingletonLock, Confirmation]:
    """A lock just granted whose confirmation is not answered yet: Redis may
    free the grant ``window`` seconds from now unless it is confirmed."""
    confirmation = Confirmation(clock() + window, sent_at=clock())
    lock = SingletonLock(LockKeys("singleton:", "0" * 32), task_id="t", exec_id="e", token=5,
                         lease=lease, started=clock(), held=True, margin=margin, clock=clock,
                         confirmation=confirmation)
    return lock, confirmation


def test_an_unconfirmed_grant_counts_only_until_redis_may_free_it():
    """Until its confirmation is answered the holder counts on its lock to
    the end of the grant's window, not its lease: past it the lock is in
    doubt (lost, check() says why), not lost for good."""
    clock = Clock()
    lock, _ = unconfirmed(clock)
    assert lock.confirming and lock.confirm_until == clock() + 4.0
    clock.now += 3.9
    assert not lock.lost
    lock.check()
    clock.now += 0.2
    assert (lock.lost, lock.in_doubt, lock.gone) == (True, True, False)
    with pytest.raises(LockLostError, match=re.escape(
            f"lock {lock.key} (token 5) was lost: its grant was not confirmed in time")):
        lock.check()
    assert "in doubt" in repr(lock)


def test_a_confirmation_that_found_the_lock_ours_gives_the_whole_lease_from_its_send():
    """Answered RENEWED, even after the window ended (a slow reader, no
    overlap: the key was still ours when it ran): no doubt is left, and the
    lease counts from when the confirmation left."""
    clock = Clock()
    lock, confirmation = unconfirmed(clock, margin=0.3)
    sent = confirmation.sent_at
    clock.now += 5.0  # past the window: in doubt
    assert lock.in_doubt
    confirmation.answered(Renew.RENEWED)
    assert (lock.lost, lock.confirming, lock.confirm_until) == (False, False, None)
    clock.now = sent + 30.0 - 0.3 - 0.05
    assert not lock.lost
    clock.now = sent + 30.0 - 0.3 + 0.05
    assert lock.gone


@pytest.mark.parametrize("answer", [Renew.NOT_OURS, Renew.ABSENT])
def test_a_confirmation_that_did_not_find_the_lock_ours_leaves_it_in_doubt_at_once(answer):
    """Answered anything but RENEWED, within the window: in doubt at once,
    not lost for good (the renewer's next round decides); a renewal finding
    it still ours then clears the doubt, one that does not makes it gone."""
    clock = Clock()
    lock, confirmation = unconfirmed(clock)
    clock.now += 1.0
    confirmation.answered(answer)
    assert (lock.lost, lock.in_doubt, lock.gone) == (True, True, False)
    lock.renewed(sent_at=clock())
    assert not lock.lost and not lock.confirming
    other, confirmation = unconfirmed(clock)
    confirmation.answered(answer)
    other.mark_lost("taken over")
    assert (other.gone, other.in_doubt, other.confirming) == (True, False, False)
    with pytest.raises(LockLostError, match="taken over"):
        other.check()


def test_a_confirmation_answered_before_its_holder_listened_counts_at_once():
    """The answer may be read (another thread's call) before the lock is
    made from the grant: the lock is confirmed as it is made."""
    clock = Clock()
    confirmation = Confirmation(clock() + 4.0, sent_at=clock())
    confirmation.answered(Renew.RENEWED)
    lock = SingletonLock(LockKeys("singleton:", "0" * 32), task_id="t", exec_id="e", token=5,
                         lease=30.0, started=clock(), held=True, clock=clock,
                         confirmation=confirmation)
    assert not lock.confirming
    clock.now += 20.0
    assert not lock.lost


def test_a_renewal_before_the_confirmations_answer_clears_the_doubt():
    clock = Clock()
    lock, _ = unconfirmed(clock)
    clock.now += 5.0
    assert lock.in_doubt
    lock.renewed(sent_at=clock())
    assert not lock.lost and not lock.confirming
    clock.now += 29.0
    assert not lock.lost


@pytest.mark.parametrize("answer, error, reason", [
    (Released(Release.RELEASED), None, None),
    (Released(Release.FREE, repeated=True), None, None),  # the first attempt freed it
    (None, ConnectionError("gone"), None),  # it frees by its lease: nothing known
    (None, None, None),  # no reply read at all: the same
    (Released(Release.FREE), None, "at release the lease had run out (the key was free)"),
    (Released(Release.TAKEN), None, "at release another execution held the key"),
    (Released(Release.TAKEN, repeated=True), None,
     "at release another execution held the key (the release was repeated after a lost "
     "reply: the first attempt may have freed it before that execution took it)"),
])
def test_what_a_release_found_tells_the_lock(answer, error, reason):
    """Read after the task returned: a release that found the key free (not
    repeated) or another execution's says the lock was lost before the end,
    and why; a release that freed it, repeated and found it free, or got no
    answer, says nothing of the kind."""
    clock = Clock()
    lock = held(clock)
    lock.released(answer, error)
    assert lock.gone is (reason is not None)
    if reason is not None:
        with pytest.raises(LockLostError, match=re.escape(f"was lost: {reason}") + "$"):
            lock.check()
