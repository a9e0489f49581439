"""OpenTelemetry: the lock's facts on each task's span, on a real prefork worker.

The worker runs ``opentelemetry-instrumentation-celery`` with the SDK's
in-memory exporter in each pool process (tests/otelapp.py); the spans come
back through Redis. Skipped when OpenTelemetry is not installed (extra 'otel').
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from typing import Any, Iterator, Optional

import pytest

from celery_singleton_lock.keys import digest, encode_value
from tests.support import ROOT, RedisServer, Worker, discard, installed, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

otel = pytest.mark.usefixtures("otel_installed")


@pytest.fixture
def otel_installed() -> None:
    for module in ("opentelemetry", "opentelemetry.sdk", "opentelemetry.instrumentation.celery"):
        installed(module, "extra 'otel'")


def traced_worker(redis_server: RedisServer, concurrency: int = 3,
                  conf: Optional[dict[str, Any]] = None) -> Worker:
    """A worker of tests.otelapp (``conf``: its settings), started."""
    worker = Worker(redis_server.url(), f"otel-{uuid.uuid4().hex[:6]}", concurrency=concurrency,
                    conf=conf)
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.otelapp:app"
    worker.start()
    return worker


@pytest.fixture(scope="module")
def traced(redis_server: RedisServer) -> Iterator[tuple[Worker, Any]]:
    worker = traced_worker(redis_server)
    yield worker, make_app(redis_server.url(), worker.queue)
    discard(worker)


def spans(redis_server: RedisServer) -> list[dict[str, Any]]:
    return [json.loads(s) for s in redis_server.client(3).lrange("spans", 0, -1)]


def runs_of(redis_server: RedisServer, task_id: str) -> list[dict[str, Any]]:
    """The run spans of ``task_id`` with the lock's facts, in the order they ended."""
    return [s for s in spans(redis_server) if s["name"].startswith("run/")
            and s["attributes"].get("messaging.message.id") == task_id
            and "singleton.outcome" in s["attributes"]]


def span_of(redis_server: RedisServer, task_id: str, run: int = 1) -> dict[str, Any]:
    """The span of ``task_id``'s ``run``-th run (a task id may run more than once)."""
    found: list[dict[str, Any]] = wait_for(
        lambda: len(runs := runs_of(redis_server, task_id)) >= run and runs, 30,
        what=f"the span of run {run} of {task_id}")
    return found[run - 1]


@otel
def test_each_run_span_carries_the_locks_facts(traced, redis_server, events, key):
    _, app = traced
    redis_server.client(3).delete("spans")
    first = app.tasks["t.hold"].delay(key, 2.0, "first")
    wait_for(lambda: events.starts("first"), 20, what="the first to start")
    skipped = app.tasks["t.hold"].delay(key, 0.0, "dup")
    holder = app.tasks["t.hold_retry"].delay(key, 2.0, "holder")
    wait_for(lambda: events.starts("holder"), 20, what="the holder to start")
    waiting = app.tasks["t.hold_retry"].delay(key, 0.0, "wait")
    result = first.get(timeout=20)
    assert skipped.get(timeout=20)["skipped"] is True

    ran = span_of(redis_server, first.id)["attributes"]
    keys = app.tasks["t.hold"].singleton_keys(key)
    assert ran["singleton.outcome"] == "ran"
    assert ran["singleton.key"] == keys.base
    # the digest alone, as the key is made of it (not the key, nor its braces)
    assert ran["singleton.key_digest"] == digest(["t.hold", f"key={encode_value(key)}"])
    assert keys.base == f"singleton:{{{ran['singleton.key_digest']}}}"
    assert ran["singleton.token"] == result["token"] and ran["singleton.slot"] == 1
    assert ran["singleton.wait_ms"] >= 0

    skip = span_of(redis_server, skipped.id)
    assert skip["attributes"]["singleton.outcome"] == "skipped"
    assert skip["attributes"]["singleton.reason"] == "duplicate"
    assert skip["attributes"]["singleton.holder"] == first.id
    assert [e["name"] for e in skip["events"]] == ["singleton.skipped"]
    assert skip["events"][0]["attributes"]["singleton.holder"] == first.id

    # the waiting call: first sent again, then it ran (same task id, two spans)
    assert waiting.get(timeout=30)["tag"] == "wait"

    def runs_of_waiting() -> list[dict]:
        return [s["attributes"] for s in spans(redis_server)
                if s["attributes"].get("messaging.message.id") == waiting.id
                and "singleton.outcome" in s["attributes"]]

    # a span is exported when it ends, which may come after the result is stored
    wait_for(lambda: [r["singleton.outcome"] for r in runs_of_waiting()][-1:] == ["ran"], 20,
             what="the span of the waiting call's run")
    runs = runs_of_waiting()
    assert {r["singleton.outcome"] for r in runs[:-1]} == {"retried"}, runs
    assert runs[0]["singleton.outcome"] == "retried" and runs[-1]["singleton.outcome"] == "ran"
    assert runs[0]["singleton.holder"] == holder.id
    assert runs[0]["singleton.reason"] == "duplicate"


@otel
def test_the_slot_under_a_limit_is_on_the_span(traced, redis_server, events, key):
    _, app = traced
    limit2 = app.tasks["t.limit2"]
    calls = [limit2.delay(key, 1.0, f"l{i}") for i in range(2)]
    slots = {c.get(timeout=20)["slot"] for c in calls}
    assert slots == {1, 2}
    assert {span_of(redis_server, c.id)["attributes"]["singleton.slot"] for c in calls} == slots


@otel
def test_a_duplicate_refused_with_raise_has_a_failed_span(traced, redis_server, events, key):
    """``singleton_on_duplicate="raise"``: the duplicate's span says ``failed``,
    why (``duplicate``) and who holds the key; no skip event."""
    _, app = traced
    task = app.tasks["t.hold_raise"]
    first = task.delay(key, 30.0, "first")
    wait_for(lambda: events.starts("first"), 20, what="the first to start")
    dup = task.delay(key, 0.0, "dup")
    dup.get(timeout=20, propagate=False)
    assert dup.state == "FAILURE" and type(dup.result).__name__ == "DuplicateTaskError"
    redis_server.client(3).set(f"finish:{key}", 1)  # the first ends now
    assert first.get(timeout=20)["tag"] == "first"

    failed = span_of(redis_server, dup.id)
    assert failed["attributes"]["singleton.outcome"] == "failed"
    assert failed["attributes"]["singleton.reason"] == "duplicate"
    assert failed["attributes"]["singleton.holder"] == first.id
    assert "singleton.token" not in failed["attributes"]
    assert "singleton.skipped" not in [e["name"] for e in failed["events"]]
    assert not events.starts("dup")


@otel
def test_a_late_copy_of_a_finished_task_has_a_dropped_span(traced, redis_server, events, key):
    """A copy of a finished ``acks_late`` task, sent again under its id, is
    dropped: its span says ``dropped`` and why, and it did not run."""
    worker, app = traced
    task = app.tasks["t.hold_late"]
    res = task.delay(key, 0.0, "done")
    assert res.get(timeout=20)["tag"] == "done"
    assert span_of(redis_server, res.id)["attributes"]["singleton.outcome"] == "ran"
    task.apply_async((key, 0.0, "done-again"), task_id=res.id)

    dropped = span_of(redis_server, res.id, run=2)["attributes"]
    assert dropped["singleton.outcome"] == "dropped"
    assert dropped["singleton.reason"] == "this task id already finished"
    assert dropped["singleton.key"] == task.singleton_keys(key).base
    assert "singleton.token" not in dropped
    assert f"Dropped redelivered t.hold_late[{res.id}]" in worker.logs()
    assert [e["tag"] for e in events.starts() if e["id"] == res.id] == ["done"]


@otel
def test_a_run_without_the_lock_redis_has_a_ran_unlocked_span(redis_server, own_redis, events,
                                                             key):
    """Lock Redis down under ``singleton_on_backend_error = "run"``: the body
    runs without a lock and its span says ``ran_unlocked``, why, and carries no
    fencing token."""
    conf = {"singleton_redis_url": own_redis.url(2), "singleton_on_backend_error": "run"}
    worker = traced_worker(redis_server, concurrency=1, conf=conf)
    try:
        app = make_app(redis_server.url(), worker.queue, conf=conf)
        own_redis.stop()
        res = app.tasks["t.hold"].delay(key, 0.0, "unlocked")
        out = res.get(timeout=30)
        assert out["tag"] == "unlocked" and out["token"] == 0

        unlocked = span_of(redis_server, res.id)["attributes"]
        assert unlocked["singleton.outcome"] == "ran_unlocked"
        assert unlocked["singleton.reason"] == "lock backend unavailable"
        assert unlocked["singleton.key"] == app.tasks["t.hold"].singleton_keys(key).base
        assert "singleton.token" not in unlocked and "singleton.slot" not in unlocked
        assert [e["tag"] for e in events.starts() if e["id"] == res.id] == ["unlocked"]
    finally:
        discard(worker)


def test_without_opentelemetry_nothing_of_it_is_imported():
    """A worker process's path through the library where OpenTelemetry cannot
    be imported: the trace hooks look it up in sys.modules, never import it
    (an import would raise here), and do nothing."""
    code = textwrap.dedent('''
        import sys
        sys.modules["opentelemetry"] = None  # any import of it raises ImportError
        from celery_singleton_lock.observe import traces
        from celery_singleton_lock.keys import LockKeys
        from celery_singleton_lock.conflict.policies import Decision, Do
        import celery_singleton_lock.task, celery_singleton_lock.conflict.outcomes
        keys = LockKeys("singleton:", "0" * 32)
        traces.waited(keys, 0.01)
        traces.ran(keys, 5, 1)
        traces.decided(keys, Decision(Do.SKIP, holder="h", reason="duplicate"))
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry.")))
    ''')
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
