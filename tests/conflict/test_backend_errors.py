"""Lock Redis unavailable: a policy, never a silent drop or a worker crash.

The lock Redis here is a server of its own, separate from the broker, so it can
be stopped while the broker keeps delivering.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import LockBackendError
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


class Setup:
    def __init__(self, broker: RedisServer, lock: RedisServer, policy: str) -> None:
        conf = {"singleton_on_backend_error": policy}
        self.lock = lock
        self.worker = Worker(broker.url(), f"be-{policy}-{uuid.uuid4().hex[:6]}", concurrency=2,
                             conf=conf, lock_url=lock.url(2)).start()
        self.app = make_app(broker.url(), self.worker.queue, lock_url=lock.url(2), conf=conf)

    def alive(self) -> bool:
        return self.worker.proc is not None and self.worker.proc.poll() is None


@pytest.fixture
def setup_for(redis_server: RedisServer, own_redis: RedisServer) -> Iterator[Any]:
    made: list[Setup] = []

    def make(policy: str) -> Setup:
        s = Setup(redis_server, own_redis, policy)
        made.append(s)
        return s

    yield make
    for s in made:
        discard(s.worker)


def outage_rounds(worker: Worker, task_id: str) -> list[float]:
    """The countdowns of ``task_id``'s rounds of waiting for the lock Redis, as
    the worker logged each (``... sent again in 1.2 s``)."""
    return [float(n) for n in re.findall(
        rf"Lock backend unavailable for t\.hold\[{task_id}\] .*: sent again in ([\d.]+) s",
        worker.logs())]


def test_retry_policy_waits_for_redis_then_runs_locked(setup_for, events, key):
    """Each round of waiting for the lock Redis is sent again within twice
    ``singleton_retry_delay`` (0.2 s in the test app), never growing as a duplicate's backoff
    does: once Redis answers, the task runs within that. Four rounds decided
    without a lock, none ran."""
    s = setup_for("retry")
    s.lock.stop()
    res = s.app.tasks["t.hold"].delay(key, 0.0, "later")
    rounds = wait_for(lambda: len(outage_rounds(s.worker, res.id)) >= 4 and outage_rounds(
        s.worker, res.id), 30, what="four rounds of waiting for the lock Redis")
    assert all(0.1 <= c <= 0.4 for c in rounds), rounds  # a duplicate's: 0.2 x 2^n, to 1
    assert not events.starts("later"), "ran without its lock"
    s.lock.start()
    out = res.get(timeout=20)
    assert out["tag"] == "later" and out["token"] > 0
    assert s.alive()


def test_run_policy_runs_without_lock_and_says_so(setup_for, events, key):
    s = setup_for("run")
    s.lock.stop()
    out = s.app.tasks["t.hold"].delay(key, 0.0, "unlocked").get(timeout=20)
    assert out["tag"] == "unlocked" and out["token"] == 0
    assert "running WITHOUT the lock" in s.worker.logs()
    assert s.alive()


def test_raise_policy_fails_the_task_with_lock_backend_error(setup_for, events, key):
    s = setup_for("raise")
    s.lock.stop()
    res = s.app.tasks["t.hold"].delay(key, 0.0, "fails")
    with pytest.raises(LockBackendError) as info:
        res.get(timeout=20)
    assert "lock backend unavailable" in str(info.value)
    assert not events.starts("fails")
    assert s.alive()


def test_redis_stopped_mid_run_marks_lock_lost_and_worker_survives(setup_for, events, key):
    """The holder cannot renew: it learns the lock is lost once its lease has
    passed; release fails quietly; the worker goes on serving."""
    s = setup_for("retry")
    res = s.app.tasks["t.hold"].delay(key, 4.0, "orphan")
    wait_for(lambda: events.starts("orphan"), 10, what="start")
    s.lock.stop()
    out = res.get(timeout=30)
    assert out["lost"] is True
    assert "Lost singleton lock" in s.worker.logs()
    s.lock.start()
    assert s.app.tasks["t.hold"].delay(key, 0.0, "after").get(timeout=20)["tag"] == "after"
    assert s.alive()
