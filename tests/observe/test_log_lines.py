"""What an operator reads in a real worker's log: a wait is one line per round
that says whom it waits for; a duplicate refused under ``raise`` is expected,
not an error; the lock Redis going away names what failed, not redis-py's
error category, and its return is news, not a warning."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.worker.heartbeat import Heartbeat
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def setup(redis_server: RedisServer) -> Iterator[tuple[Worker, Any]]:
    worker = Worker(redis_server.url(), f"log-{uuid.uuid4().hex[:8]}", concurrency=2).start()
    try:
        yield worker, make_app(redis_server.url(), worker.queue)
    finally:
        discard(worker)


def lines_of(worker: Worker, task_id: str) -> list[str]:
    return [line for line in worker.logs().splitlines() if task_id in line]


def test_a_waiting_duplicate_logs_one_line_per_round_naming_its_holder(setup, events, key):
    """Under the retry policy each round the duplicate is sent again is one
    INFO line of ours, naming the holder, its state, the key and the countdown;
    Celery's own "retry:" line for the same round is not written beside it."""
    worker, app = setup
    t = app.tasks["t.hold_retry"]
    holder = t.delay(key, 1.5, "holder")
    start = wait_for(lambda: events.starts("holder"), 10, what="holder start")[0]
    dup = t.delay(key, 0.0, "waiter")
    assert dup.get(timeout=20)["tag"] == "waiter"
    holder.get(timeout=10)
    wait_for(lambda: any("succeeded" in line for line in lines_of(worker, dup.id)), 10,
             what="the duplicate's end in the log")
    lines = lines_of(worker, dup.id)
    rounds = sum(line.endswith(" received") for line in lines) - 1
    waits = [line for line in lines if f"t.hold_retry[{dup.id}] waits:" in line]
    assert rounds >= 1 and len(waits) == rounds, lines
    pattern = (rf"\[[^]]+: INFO/ForkPoolWorker-\d+\] Task t\.hold_retry\[{dup.id}\] waits: "
               rf"duplicate of {holder.id} \(running\), key {re.escape(start['lockkey'])}; "
               r"sent again in \d+\.\d s")
    assert all(re.fullmatch(pattern, line) for line in waits), waits
    assert not [line for line in lines if " retry: " in line or "(duplicate)" in line], lines


def test_a_duplicate_refused_under_raise_is_expected_not_an_error(setup, events, key):
    """The raise policy refuses a duplicate on purpose: Celery logs it as an
    expected exception (INFO, no traceback), the message saying what is held
    and by whom, not the exception's constructor arguments."""
    worker, app = setup
    t = app.tasks["t.hold_raise"]
    holder = t.delay(key, 1.5, "holder")
    start = wait_for(lambda: events.starts("holder"), 10, what="holder start")[0]
    dup = t.delay(key, 0.0, "refused")
    with pytest.raises(Exception, match="already running"):
        dup.get(timeout=10, propagate=True)
    holder.get(timeout=10)
    [line] = [line for line in lines_of(worker, dup.id) if "raised" in line]
    assert re.fullmatch(
        rf"\[[^]]+: INFO/ForkPoolWorker-\d+\] Task t\.hold_raise\[{dup.id}\] raised expected: "
        rf"DuplicateTaskError\(\"task 't\.hold_raise' is already running under key "
        rf"{re.escape(start['lockkey'])} \(holder task id {holder.id}\)\"\)", line), line
    assert "Traceback" not in worker.logs().split(line, 1)[1].split("\n[", 1)[0]


def test_an_outage_names_what_failed_and_its_end_is_logged_at_info(
        redis_server: RedisServer, own_redis: RedisServer, events: Any, key: str) -> None:
    """The lock Redis stops while a task waits for it: the lines name the
    error's type and text (never redis-py 8's bare category such as
    ``network:ConnectionError``), each round of the waiting task is one line,
    and the return of Redis is logged at INFO."""
    worker = Worker(redis_server.url(), f"log-{uuid.uuid4().hex[:8]}", concurrency=1,
                    lock_url=own_redis.url(2)).start()
    try:
        app = make_app(redis_server.url(), worker.queue, lock_url=own_redis.url(2))
        app.tasks["t.hold"].delay(f"{key}-warm", 0.0, "warm").get(timeout=10)
        own_redis.stop()
        late = app.tasks["t.hold"].delay(key, 0.0, "late")
        wait_for(lambda: worker.logs().count(f"t.hold[{late.id}] (") >= 3, 30,
                 what="three rounds of the task waiting for Redis")
        own_redis.start()
        assert late.get(timeout=30)["tag"] == "late"
        wait_for(lambda: "answers again, after" in worker.logs(), 10, what="Redis back in the log")
        log = worker.logs()
    finally:
        discard(worker)
    assert not re.search(r"\b(network|server|timeout|auth):[A-Z]\w+", log), log
    waits = [line for line in log.splitlines() if f"t.hold[{late.id}] (" in line]
    assert all(re.search(r"WARNING/ForkPoolWorker-\d+\] Lock backend unavailable for "
                         rf"t\.hold\[{late.id}\] \(\w+: .+\): sent again in \d+\.\d s$",
                         line) for line in waits), waits
    assert f"t.hold[{late.id}] retry:" not in log
    back = [line for line in log.splitlines()
            if "answers again, after" in line or "is back (" in line]
    assert back and all("INFO/" in line for line in back), back


@pytest.mark.parametrize("holding", [1, 0])
def test_losing_the_lock_redis_is_a_warning_only_while_a_lock_is_held(
        holding: int, caplog: pytest.LogCaptureFixture) -> None:
    """The renewal thread watches the lock Redis's connection: losing it while
    it holds a lock is a WARNING naming how many; losing it with none held (a
    test suite's Redis stopped at the end of its session, with the renewer of
    an in-process worker still watching) is DEBUG, so it never reaches a
    terminal whose logging is not configured."""
    caplog.set_level(logging.DEBUG, logger="celery_singleton_lock")
    server = RedisServer().start()
    try:
        engine = connect(SingletonConfig.defaults(server.url(0)))
        hb = Heartbeat(engine)
        keys = LockKeys("singleton:", uuid.uuid4().hex)
        got = engine.acquire(keys, Request(task_id="t", exec_id="e", lease=Lease.of_ms(1500),
                                           hostname="h", retries=0,
                                           task_name="t.x"))
        lock = SingletonLock(keys, task_id="t", exec_id="e", token=got.token, lease=1.5,
                             started=time.monotonic(), held=True)
        hb.add(lock)
        wait_for(lambda: hb.rounds >= 1, 10, what="a renewal round (the watch connected)")
        if not holding:
            hb.discard(lock)
        caplog.clear()
        server.stop()

        def lost() -> list[logging.LogRecord]:
            return [r for r in caplog.records
                    if r.getMessage().startswith("Lost the connection to the lock Redis")]

        [record] = wait_for(lost, 15, what="the renewer seeing the connection go")
        hb.discard(lock)
    finally:
        server.cleanup()
    assert record.levelno == (logging.WARNING if holding else logging.DEBUG), record
    assert f"holding {holding} lock(s)" in record.getMessage()
