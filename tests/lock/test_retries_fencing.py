"""self.retry keeps the key; fencing tokens expose a holder whose lease ran out."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_singleton_lock import is_skipped
from tests.support import owner_field, wait_for

pytestmark = pytest.mark.worker


def test_retry_keeps_key_through_countdown_and_retried_run_takes_it_back(
        client_app, r, events, key):
    """A duplicate sent during the retry countdown is a duplicate; the retried
    execution then gets the key back (higher token) without deadlock."""
    task = client_app.tasks["t.retrier"]
    lock_key = task.singleton_keys(key).lock
    res = task.delay(key, attempts=1, countdown=3.0, tag="r")
    wait_for(lambda: events.starts("r#0"), 10, what="first attempt")
    wait_for(lambda: owner_field(r, lock_key, "handoff") == "1", 5, what="hand-off")
    time.sleep(2.2)  # past the 2 s lease: only the hand-off keeps the key now
    assert r.exists(lock_key)
    dup = task.delay(key, attempts=0, tag="dup")
    dup_result = dup.get(timeout=10)
    assert is_skipped(dup_result) and dup_result["holder"] == res.id
    final = res.get(timeout=20)
    assert final["tag"] == "r#1"
    starts = events.starts("r#")
    assert [e["retries"] for e in starts] == [0, 1]
    assert starts[1]["token"] > starts[0]["token"]
    assert not r.exists(lock_key)
    assert not events.starts("dup")


def test_several_retries_in_a_row_never_deadlock(client_app, r, events, key):
    task = client_app.tasks["t.retrier"]
    res = task.delay(key, attempts=3, countdown=0.0, tag="chain")
    assert res.get(timeout=30)["tag"] == "chain#3"
    assert [e["retries"] for e in events.starts("chain#")] == [0, 1, 2, 3]
    assert not r.exists(task.singleton_keys(key).lock)


LEASES = float(os.environ.get("SLT_LONG_TASK_LEASES", "6"))


def test_long_task_keeps_lock_for_many_times_its_lease(client_app, r, events, key):
    """Lease 1 s, task 6 s (10 s and more with SLT_LONG_TASK_LEASES): renewed
    all along, duplicates skipped to the end."""
    task = client_app.tasks["t.hold_short"]
    res = task.delay(key, LEASES, "long")
    wait_for(lambda: events.starts("long"), 10, what="start")
    skipped = 0
    while not res.ready():
        dup = task.delay(key, 0.0, "dup").get(timeout=10)
        if res.ready():
            break
        assert is_skipped(dup), dup
        skipped += 1
        time.sleep(0.5)
    assert skipped >= 5
    assert res.get(timeout=10)["lost"] is False


def test_paused_holder_sees_lost_and_lower_token(client_app, r, events, key):
    """SIGSTOP the holder past its lease, let a duplicate take the key, SIGCONT:
    the stale holder knows it lost the lock and its token is the lower one, and
    its release does not free the new holder's lock."""
    task = client_app.tasks["t.fenced"]
    lock_key = task.singleton_keys(key).lock
    stale = task.delay(key, 3.0, "stale")
    pid = wait_for(lambda: events.starts("stale"), 10, what="holder start")[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not r.exists(lock_key), 5, what="lease to run out")
        fresh = task.delay(key, 0.0, "fresh").get(timeout=10)
        assert fresh["lost"] is False and fresh["check"] == "ok"
        newest = task.delay(key, 6.0, "newest")
        wait_for(lambda: events.starts("newest"), 10, what="newest start")
    finally:
        os.kill(pid, signal.SIGCONT)
    old = stale.get(timeout=15)
    assert old["lost"] is True
    assert old["check"] == "LockLostError"
    assert old["token"] < fresh["token"]
    assert r.exists(lock_key), "the stale holder freed the new holder's lock"
    assert owner_field(r, lock_key, "task") == newest.id
    newest.get(timeout=15)
