"""``singleton_throttle``: at most one start per key per window, whatever the
outcome, across two prefork workers on one queue."""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import is_skipped
from tests.cli.test_cli import run_cli
from tests.support import Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def two_workers(redis_server: Any) -> Iterator[tuple[Worker, Worker]]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    workers = (Worker(redis_server.url(), queue, concurrency=2, name="a").start(),
               Worker(redis_server.url(), queue, concurrency=2, name="b").start())
    yield workers
    for w in workers:
        discard(w)


@pytest.fixture(scope="module")
def app(redis_server: Any, two_workers: tuple[Worker, Worker]) -> Any:
    return make_app(redis_server.url(), two_workers[0].queue)


def test_one_start_per_window_whatever_its_outcome(app, events, key, r):
    """The first start opens the window even though it fails; every call in
    the window, on either worker, is skipped as "throttled", naming the
    window's holder and when it reopens. Once it reopens, a call runs."""
    t = app.tasks["t.throttle"]
    window = t.singleton_keys(key).throttle
    first = t.delay(key, 0.3, "first", True)
    wait_for(lambda: events.starts("first"), 10, what="the first start")
    calls = [t.delay(key, 0.0, f"dup{i}") for i in range(8)]
    results = [c.get(timeout=15) for c in calls]
    with pytest.raises(ValueError):
        first.get(timeout=10)
    assert all(is_skipped(x) and x["reason"] == "throttled" and x["holder"] == first.id
               for x in results), results
    assert all(0 < x["reopens_in"] <= 3.0 for x in results), results
    # the failure did not reopen the window: a call after it is throttled too
    after_failure = t.delay(key, 0.0, "after-failure").get(timeout=10)
    assert is_skipped(after_failure) and after_failure["reason"] == "throttled"
    assert [e["tag"] for e in events.starts()] == ["first"]
    wait_for(lambda: not r.exists(window), 10, what="the window to reopen")
    reopened = t.delay(key, 0.0, "reopened").get(timeout=10)
    assert not is_skipped(reopened) and reopened["tag"] == "reopened"
    # ...and opens the next window
    name, _, opener = r.get(window).split("\n", 2)
    assert (name, opener) == ("t.throttle", events.starts("reopened")[0]["id"])


def test_retry_runs_the_call_when_the_window_reopens(app, two_workers, events, key):
    """``retry``: a call inside the window is sent again for when it reopens
    (a little after: it is never sent back to wait a second round), and then
    runs; never before the window of the run before it is over."""
    t = app.tasks["t.throttle_retry"]
    first = t.delay(key, 0.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="the first start")
    second = t.delay(key, 0.0, "second")
    assert second.get(timeout=20)["tag"] == "second"
    rounds = [line for w in two_workers for line in w.logs().splitlines()
              if f"t.throttle_retry[{second.id}] waits: throttled" in line]
    assert len(rounds) == 1, rounds
    assert first.get(timeout=5)["tag"] == "first"
    starts = {e["tag"]: e["t"] for e in events.starts()}
    assert set(starts) == {"first", "second"}
    # the window is 2 s from the first start (a little slack for the Redis clock)
    assert starts["second"] - starts["first"] >= 2.0 - 0.05, starts


def test_a_retry_of_the_task_that_opened_the_window_runs(app, events, key):
    """``self.retry`` is the same call starting again: the window it opened
    does not throttle it."""
    t = app.tasks["t.throttle_retrier"]
    result = t.delay(key, "r").get(timeout=15)
    assert not is_skipped(result) and result["tag"] == "r#1"
    assert [e["tag"] for e in events.starts()] == ["r#0", "r#1"]
    dup = t.delay(key, "dup").get(timeout=10)
    assert is_skipped(dup) and dup["reason"] == "throttled"


def test_a_bad_window_is_refused_at_definition():
    from celery import Celery

    from celery_singleton_lock import ConfigurationError, SingletonTask

    app = Celery("bad", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=SingletonTask, name="bad.window", singleton_throttle=-1, shared=False)
    def bad() -> None:
        pass

    with pytest.raises(ConfigurationError, match="singleton_throttle"):
        app.tasks["bad.window"].singleton_settings()


def test_the_cli_lists_an_open_window_and_purge_reopens_it(app, two_workers, events, key, r):
    """``list --state throttled`` shows the window's task, holder and time
    left; ``purge --yes`` deletes it, so the next call runs at once (a 120 s
    window: open through every command, however slow the machine)."""
    import json

    t = app.tasks["t.throttle_long"]
    first = t.delay(key, 0.0, "first")
    first.get(timeout=10)
    base = t.singleton_keys(key).base
    env = two_workers[0].env
    out = run_cli(env, "list", "--state", "throttled", "--json")
    assert out.returncode == 0, out.stderr
    rows = [row for row in json.loads(out.stdout)["locks"] if row["key"] == base]
    assert len(rows) == 1 and rows[0]["holder"] == first.id
    assert rows[0]["task"] == "t.throttle_long"
    assert 0 < rows[0]["ttl"] <= 120.0
    assert is_skipped(t.delay(key, 0.0, "inside").get(timeout=10))
    out = run_cli(env, "purge", "--yes", "--task", "t.throttle_long")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not r.exists(t.singleton_keys(key).throttle)
    assert t.delay(key, 0.0, "after-purge").get(timeout=10)["tag"] == "after-purge"
