"""Every way an execution ends frees its key, on a real prefork worker.

The worker here uses a 30 s lease, so a key freed within a few seconds was
released by us, not by the lease running out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from typing import Any, Iterator, Optional

import pytest
from celery.exceptions import MaxRetriesExceededError, SoftTimeLimitExceeded, TimeLimitExceeded

from tests.support import RedisServer, Worker, discard, wait_for, write_owner
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

LONG_TTL = {"singleton_ttl": 30.0}


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[Worker]:
    w = Worker(redis_server.url(), f"exit-{uuid.uuid4().hex[:8]}", concurrency=3,
               conf=LONG_TTL).start()
    yield w
    discard(w)


@pytest.fixture(scope="module")
def app(redis_server: RedisServer, worker: Worker) -> Any:
    return make_app(redis_server.url(), worker.queue, conf=LONG_TTL)


@contextlib.contextmanager
def own_worker(redis_server: RedisServer, prefix: str, concurrency: int,
               conf: Optional[dict[str, Any]] = None) -> Iterator[tuple[Worker, Any]]:
    """A worker of one test's own (it is stopped or killed by the test), and its app."""
    w = Worker(redis_server.url(), f"{prefix}-{uuid.uuid4().hex[:8]}", concurrency=concurrency,
               conf=conf).start()
    try:
        yield w, make_app(redis_server.url(), w.queue, conf=conf)
    finally:
        discard(w)


def lock_exists(app: Any, r: Any, task: str, key: str) -> bool:
    return bool(r.exists(app.tasks[task].singleton_keys(key).lock))


def started(events: Any, tag: str) -> dict[str, Any]:
    found = wait_for(lambda: events.starts(tag), 15, what=f"{tag} to start")
    return found[0]  # type: ignore[no-any-return]


def test_lock_is_held_while_running_and_released_on_success(app, r, events, key):
    res = app.tasks["t.hold"].delay(key, 1.0, "ok")
    started(events, "ok")
    assert lock_exists(app, r, "t.hold", key)
    res.get(timeout=10)
    assert not lock_exists(app, r, "t.hold", key)


def test_revoke_terminate_releases_at_once(app, r, events, key):
    """revoke(terminate=True): SIGTERM to the child; the key is free in seconds."""
    res = app.tasks["t.hold"].delay(key, 20.0, "victim")
    started(events, "victim")
    assert lock_exists(app, r, "t.hold", key)
    app.control.revoke(res.id, terminate=True)
    wait_for(lambda: not lock_exists(app, r, "t.hold", key), 5, what="key freed")
    assert app.tasks["t.hold"].delay(key, 0.0, "next").get(timeout=10)["tag"] == "next"


def test_revoke_terminate_sigkill_released_by_main_process(app, r, events, key):
    """With SIGKILL the child runs nothing: the main worker process frees the key."""
    res = app.tasks["t.hold"].delay(key, 20.0, "victim9")
    started(events, "victim9")
    app.control.revoke(res.id, terminate=True, signal="SIGKILL")
    wait_for(lambda: not lock_exists(app, r, "t.hold", key), 8, what="key freed")


def test_soft_time_limit_releases(app, r, events, key):
    res = app.tasks["t.hold_soft"].delay(key, 5.0, "soft")
    started(events, "soft")
    with pytest.raises(SoftTimeLimitExceeded):
        res.get(timeout=10)
    assert not lock_exists(app, r, "t.hold_soft", key)


def test_hard_time_limit_releases(app, r, events, key):
    res = app.tasks["t.hold_hard"].delay(key, 5.0, "hard")
    started(events, "hard")
    with pytest.raises(TimeLimitExceeded):
        res.get(timeout=10)
    wait_for(lambda: not lock_exists(app, r, "t.hold_hard", key), 8, what="key freed")


def test_hard_time_limit_of_a_body_deaf_to_sigterm_released_by_main_process(app, r, events,
                                                                              key):
    """A hard time limit whose body runs no Python code when the pool's SIGTERM
    comes (stuck in a C call): the pool kills the child with SIGKILL, no code of
    the child runs, and the main process frees the key, long before the lease."""
    res = app.tasks["t.hold_hard_deaf"].delay(key, 20.0, "deaf")
    started(events, "deaf")
    assert lock_exists(app, r, "t.hold_hard_deaf", key)
    t0 = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        res.get(timeout=10)
    wait_for(lambda: not lock_exists(app, r, "t.hold_hard_deaf", key), 10, what="key freed")
    assert time.monotonic() - t0 < 15  # the lease is 30 s
    assert not events.ends("deaf")  # the body never ended: the child was killed
    assert app.tasks["t.hold_hard_deaf"].delay(key, 0.0, "next").get(timeout=10)["tag"] == "next"


def test_a_retry_past_max_retries_releases_at_once(app, r, events, key):
    """``self.retry()`` once ``max_retries`` are spent sends no retry (Celery
    raises MaxRetriesExceededError): the key it was about to keep for the
    retry is freed at once, not when the lease kept for it runs out."""
    t = app.tasks["t.retrier"]
    res = t.delay(key, 10, 0.1, 0.0, "spent")  # 10 attempts asked, 5 retries allowed
    with pytest.raises(MaxRetriesExceededError):
        res.get(timeout=20)
    assert [e["tag"] for e in events.starts()] == [f"spent#{i}" for i in range(6)]
    t0 = time.monotonic()
    wait_for(lambda: not lock_exists(app, r, "t.retrier", key), 10, what="key freed")
    assert time.monotonic() - t0 < 5  # the lease kept for a retry is 30 s
    assert t.delay(key, 0, 0.1, 0.0, "next").get(timeout=10)["tag"] == "next#0"


def test_child_killed_with_sigkill_released_by_main_process(app, r, events, key):
    """kill -9 of the child while the main process lives: freed long before the lease."""
    res = app.tasks["t.hold"].delay(key, 20.0, "kill9")
    pid = started(events, "kill9")["pid"]
    assert lock_exists(app, r, "t.hold", key)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not lock_exists(app, r, "t.hold", key), 10, what="key freed")
    assert time.monotonic() - t0 < 15  # the lease is 30 s
    with pytest.raises(Exception, match=r"WorkerLost|exited prematurely"):
        res.get(timeout=10)


def test_warm_shutdown_finishes_task_and_releases(redis_server, r, events, key):
    with own_worker(redis_server, "warm", 2, LONG_TTL) as (w, app):
        res = app.tasks["t.hold"].delay(key, 2.0, "warm")
        started(events, "warm")
        w.signal(signal.SIGTERM)
        assert res.get(timeout=20)["tag"] == "warm"
        assert w.proc is not None and w.proc.wait(20) == 0
        assert not lock_exists(app, r, "t.hold", key)


def test_whole_worker_killed_frees_within_lease(redis_server, r, events, key):
    """kill -9 of main and children: nothing runs, the lease (2 s) frees the key."""
    with own_worker(redis_server, "dead", 1) as (w, app):
        app.tasks["t.hold"].delay(key, 30.0, "doomed")
        started(events, "doomed")
        w.kill_all()
        t0 = time.monotonic()
        assert lock_exists(app, r, "t.hold", key)
        wait_for(lambda: not lock_exists(app, r, "t.hold", key), 5, what="lease to run out")
        assert time.monotonic() - t0 <= 3.0


def test_a_pool_process_reads_its_last_release_reply_before_it_exits(redis_server, r, events,
                                                                        key):
    """A release is sent without waiting; a child that exits right after still
    reads the reply (here: the lock had been taken over, which it reports)."""
    with own_worker(redis_server, "last", 1, LONG_TTL) as (w, app):
        res = app.tasks["t.hold"].delay(key, 1.0, "last")
        started(events, "last")
        write_owner(r, app.tasks["t.hold"].singleton_keys(key).lock, exec="someone-else")
        assert res.get(timeout=10)["lost"] is False  # the heartbeat (10 s) did not look
        w.signal(signal.SIGTERM)
        assert w.proc is not None and w.proc.wait(20) == 0
        assert "at release another execution held the key" in w.logs()
