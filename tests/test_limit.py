"""``singleton_limit = N``: at most N executions per key at once, each in a
slot of its own with its own fencing token, across two prefork workers."""

from __future__ import annotations

import json
import os
import signal
import uuid
from typing import Any, Iterator

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, SingletonTask, is_skipped
from tests.support import Worker, wait_for
from tests.test_cli import run_cli
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def two_workers(redis_server: Any) -> Iterator[tuple[Worker, Worker]]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    workers = (Worker(redis_server.url(), queue, concurrency=3, name="a").start(),
               Worker(redis_server.url(), queue, concurrency=3, name="b").start())
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def app(redis_server: Any, two_workers: tuple[Worker, Worker]) -> Any:
    return make_app(redis_server.url(), two_workers[0].queue)


def test_at_most_n_run_at_once_each_in_its_own_slot(app, events, key, two_workers):
    """Eight calls of one key on six processes: three run, in slots 1 to 3,
    each with its own token; the others are skipped naming a holder. While
    they run, `celery singleton key` shows 3/3 slots used."""
    t = app.tasks["t.limit3"]
    calls = [t.delay(key, 3.0, f"c{i}") for i in range(8)]
    wait_for(lambda: len(events.starts()) >= 3, 15, what="three starts")
    out = run_cli(two_workers[0].env, "key", "t.limit3", "--args", json.dumps([key]), "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["limit"], shown["slots_used"]) == (3, 3)
    assert sorted(r["slot"] for r in shown["locks"] if r["state"] == "run") == [1, 2, 3]
    results = [c.get(timeout=20) for c in calls]
    ran = [r for r in results if not is_skipped(r)]
    skipped = [r for r in results if is_skipped(r)]
    assert len(ran) == 3 and sorted(r["slot"] for r in ran) == [1, 2, 3]
    assert len({r["token"] for r in ran}) == 3
    ids = {c.id for c in calls}
    assert len(skipped) == 5 and all(s["reason"] == "duplicate" and s["holder"] in ids
                                     for s in skipped)
    assert max(e["concurrent"] for e in events.starts()) == 3


def test_retry_runs_every_call_never_more_than_n_and_tokens_go_up(app, events, key):
    t = app.tasks["t.limit2_retry"]
    calls = [t.delay(key, 0.5, f"r{i}") for i in range(4)]
    results = [c.get(timeout=60) for c in calls]
    assert not any(is_skipped(r) for r in results)
    starts = events.starts()
    assert len(starts) == 4 and max(e["concurrent"] for e in starts) <= 2
    tokens = [e["token"] for e in sorted(starts, key=lambda e: e["t"])]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4


def test_a_killed_child_frees_its_slot(app, events, key, r):
    """kill -9 of the child holding slot 2: the main worker process frees
    that slot (and only it), and the next call runs in it."""
    t = app.tasks["t.limit2"]
    holders = [t.delay(key, 60.0, f"h{i}") for i in range(2)]
    wait_for(lambda: len(events.starts("h")) == 2, 15, what="both slots taken")
    full = t.delay(key, 0.0, "full").get(timeout=10)
    assert is_skipped(full)
    keys = t.singleton_keys(key)
    victim = next(e for e in events.starts("h")
                  if r.get(keys.slot(2).lock) and r.get(keys.slot(2).lock).endswith(e["id"]))
    other = next(e for e in events.starts("h") if e is not victim)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: not r.exists(keys.slot(2).lock), 15, what="slot 2 freed")
    assert r.get(keys.slot(1).lock).endswith(other["id"])
    after = t.delay(key, 0.0, "after").get(timeout=10)
    assert not is_skipped(after) and after["slot"] == 2
    for h in holders:
        app.control.revoke(h.id, terminate=True)


def test_a_limit_goes_with_the_run_scope_only():
    app = Celery("bad", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=SingletonTask, name="bad.limit", singleton_limit=2,
              singleton_scope="queue")
    def bad() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"singleton_limit: task 'bad\.limit': 2 per"):
        app.tasks["bad.limit"].singleton_settings()

    @app.task(base=SingletonTask, name="bad.zero", singleton_limit=0)
    def zero() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"singleton_limit.*whole number >= 1"):
        app.tasks["bad.zero"].singleton_settings()
