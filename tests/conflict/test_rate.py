"""singleton_rate: at most N starts of a key in any window, across two prefork workers.

A steady stream for 12 s (``SLT_RATE_SECONDS=30``: 30 s), two tasks on it:
one that skips a call over the limit (and may run two at once,
``singleton_limit=2``), one that sends it again for when the window reopens.
The windows are checked on the scores the grants wrote (the lock Redis's
clock), not on when each body happened to run.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.checks import doctor as checks
from celery_singleton_lock.checks import permissions
from celery_singleton_lock.checks.doctor import uses_rate
from celery_singleton_lock.config import parse_rate as parse
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.exceptions import ConfigurationError
from tests.rateapp import RATE, make_rate_app
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

STARTS, WINDOW_MS = parse(RATE)
#: how long the steady stream runs (``SLT_RATE_SECONDS=30`` is the long form)
STREAM_SECONDS = float(os.environ.get("SLT_RATE_SECONDS", "12"))


def crowded(scores: list[float]) -> list[tuple[float, float]]:
    """Every N+1 consecutive starts closer together than the window: none may be."""
    s = sorted(scores)
    return [(s[i], s[i + STARTS]) for i in range(len(s) - STARTS)
            if s[i + STARTS] - s[i] < WINDOW_MS]


@pytest.fixture(scope="module")
def rate_workers(redis_server: RedisServer) -> Iterator[list[Worker]]:
    queue = f"rate-{uuid.uuid4().hex[:8]}"
    workers = []
    for _ in range(2):
        worker = Worker(redis_server.url(), queue, concurrency=2)
        worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.rateapp:app"
        workers.append(worker.start())
    yield workers
    for worker in workers:
        discard(worker)


def events(redis_server: RedisServer) -> list[dict[str, Any]]:
    return [json.loads(e) for e in redis_server.client(3).lrange("rate-events", 0, -1)]


@pytest.mark.timeout(240)
def test_a_steady_stream_never_puts_more_than_n_starts_in_a_window(redis_server, rate_workers):
    """12 s (30 s in the long form): a call of the skipping task every 0.1 s,
    one of the waiting task every 0.3 s (a third over the limit), each on its own key. No 2 s window
    holds more than 5 starts of either; every skip says "rate limited" or is a
    duplicate of a running call (two may run at once); every waiting call
    runs, once."""
    redis_server.client(3).delete("rate-events")
    app = make_rate_app(redis_server.url(), rate_workers[0].queue)
    skip_key, wait_key = f"s-{uuid.uuid4().hex[:6]}", f"w-{uuid.uuid4().hex[:6]}"
    skipping, waiting = [], []
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < STREAM_SECONDS:
        skipping.append(app.tasks["t.rated"].delay(skip_key, 0.3))
        if n % 3 == 0:
            waiting.append(app.tasks["t.rated_wait"].delay(wait_key, 0.05))
        n += 1
        time.sleep(0.1)

    waited_ids = {r.id for r in waiting}

    def waited_started() -> bool:
        return waited_ids <= {e["id"] for e in events(redis_server) if e["key"] == wait_key}

    wait_for(waited_started, 120, interval=0.5, what="every waiting call to start")
    results = [r.get(timeout=60) for r in skipping]
    runs = events(redis_server)

    for key in (skip_key, wait_key):
        scores = [e["score"] for e in runs if e["key"] == key]
        assert None not in scores
        assert not crowded(scores), (key, crowded(scores)[:5])
    # the waiting task: every call ran, once
    starts = Counter(e["id"] for e in runs if e["key"] == wait_key)
    assert set(starts) == waited_ids and set(starts.values()) == {1}
    # the skipping task: a call started or was skipped, for the rate or as a duplicate
    started = {e["id"] for e in runs if e["key"] == skip_key}
    reasons = Counter(r["reason"] for r in results if isinstance(r, dict) and r.get("skipped"))
    assert len(started) + sum(reasons.values()) == len(skipping), reasons
    assert reasons["rate limited"] > 0 and set(reasons) <= {"rate limited", "duplicate"}
    # the limit was reached, window after window
    assert len(started) >= STARTS * (STREAM_SECONDS * 1000 / WINDOW_MS) / 3
    # two at once (singleton_limit=2): both slots were used
    assert {e["slot"] for e in runs if e["key"] == skip_key} == {1, 2}
    # both workers took part
    assert len({e["pid"] for e in runs}) >= 2
    waits = [e["waits"] for e in runs if e["key"] == wait_key]
    assert max(waits) > 0  # the limit was reached: calls were sent again
    print(f"\nskipping: {len(started)} started of {len(skipping)} ({dict(reasons)}); "
          f"waiting: {len(waiting)} calls, sent again {sum(waits)} times in all, "
          f"at most {max(waits)} for one call")


def test_the_rate_setting_is_checked_with_a_clear_error():
    assert parse("10/m") == (10, 60000)
    assert parse("100/30s") == (100, 30000)
    assert parse("5/2h") == (5, 7200000)
    for bad in ("10", "10/x", "0/m", "-1/m", "1.5/m", 10):
        with pytest.raises(ConfigurationError, match="singleton_rate"):
            SingletonConfig.defaults("redis://127.0.0.1:1/0").for_task("t", {"singleton_rate": bad})
    with pytest.raises(ConfigurationError, match="choose one"):
        SingletonConfig.defaults("redis://127.0.0.1:1/0").for_task(
            "t", {"singleton_rate": "1/m", "singleton_throttle": 5})
    with pytest.raises(ConfigurationError, match="redlock"):
        SingletonConfig.defaults("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3").for_task(
            "t", {"singleton_rate": "1/m"})


@pytest.mark.parametrize("command", permissions.RATE_COMMANDS)
def test_a_lock_user_that_may_not_run_what_the_rate_needs_stops_a_worker_of_such_tasks(
        command):
    """The worker's rule stays as documented without singleton_rate; a worker
    whose app has it tries the rate-limited acquire at start and refuses to
    start when its lock user may not run one of the five commands, naming it."""
    with RedisServer() as server:
        rule = permissions.acl_rule("singleton:", 2, rate=True)
        assert all(f"+{c}" in rule.split() for c in permissions.RATE_COMMANDS)
        assert not any(f"+{c}" in permissions.acl_rule("singleton:", 2).split()
                       for c in permissions.RATE_COMMANDS)
        server.client().execute_command("ACL", "SETUSER", "locks", "on", ">pw", *rule.split(),
                                        f"-{command}")
        engine = connect(SingletonConfig.defaults(
            f"redis://locks:pw@127.0.0.1:{server.port}/2"))
        checks.startup_check(engine)  # no task with a rate: nothing more is needed
        with pytest.raises(ConfigurationError, match=rf"\b{command}\b"):
            checks.startup_check(engine, rate=True)
        server.client().execute_command("ACL", "SETUSER", "locks", f"+{command}")
        checks.startup_check(engine, rate=True)
        assert server.client(2).dbsize() == 0 or all(
            server.client(2).pttl(k) > 0 for k in server.client(2).keys("*"))


def test_a_worker_knows_its_app_uses_a_rate():
    app = make_rate_app("redis://127.0.0.1:1/0", "q")
    assert uses_rate(app)
    plain = make_app("redis://127.0.0.1:1/0", "q")
    assert not uses_rate(plain)
    plain.conf.singleton_rate = "5/m"
    assert uses_rate(plain)
