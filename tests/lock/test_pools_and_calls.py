"""Solo and threads pools, direct calls and eager mode."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from celery_singleton_lock import SingletonTask, is_skipped
from tests.support import RedisServer, Worker, dead_port, discard, wait_for, write_owner
from tests.workerapp import make_app


@pytest.mark.worker
@pytest.mark.parametrize("pool,concurrency", [("solo", 1), ("threads", 4)])
def test_pool_runs_one_per_key_and_releases(pool, concurrency, redis_server, r, events, key):
    w = Worker(redis_server.url(), f"{pool}-{uuid.uuid4().hex[:6]}", pool=pool,
               concurrency=concurrency).start()
    try:
        app = make_app(redis_server.url(), w.queue)
        hold = app.tasks["t.hold"]
        if pool == "solo":
            # one process, one task at a time: the holder is not running when the
            # duplicate is picked up, so plant a foreign holder to be skipped against
            keys = hold.singleton_keys(key)
            write_owner(r, keys.lock, task="foreign", exec="x", pid=0)
            r.pexpire(keys.lock, 5000)
            assert hold.delay(key, 0.0, "dup").get(timeout=10)["holder"] == "foreign"
            r.delete(keys.lock)
        first = hold.delay(key, 1.0 if pool == "threads" else 0.0, "first")
        if pool == "threads":
            wait_for(lambda: events.starts("first"), 10, what="start")
            dups = [hold.delay(key, 0.0, f"dup{i}") for i in range(3)]
            for d in dups:
                assert is_skipped(d.get(timeout=10))
            # a long lease-short task on threads keeps its lock too
            short = app.tasks["t.hold_short"].delay(key + "-short", 2.0, "short")
        assert first.get(timeout=10)["tag"] == "first"
        if pool == "threads":
            assert short.get(timeout=10)["lost"] is False
        assert max(e["concurrent"] for e in events.starts()) == 1
        assert not r.exists(hold.singleton_keys(key).lock)
    finally:
        discard(w)


class Opaque:
    """Pickles, but has no canonical form."""


def _unreachable_app() -> Any:
    """An app whose lock Redis does not exist: any Redis call would fail."""
    dead = f"redis://127.0.0.1:{dead_port()}/0"
    return make_app(dead, "unused", conf={"singleton_redis_options": {
        "socket_connect_timeout": 0.2, "retry_on_timeout": False}})


def test_direct_call_runs_body_without_redis():
    """task(...) is a function call: no lock, no Redis, token 0."""
    app = _unreachable_app()

    @app.task(base=SingletonTask, bind=True, name="t.direct", shared=False)
    def direct(self: Any, order_id: int) -> dict[str, Any]:
        self.singleton.check()
        return {"token": self.singleton.token, "lost": self.singleton.lost,
                "key": self.singleton.key}

    out = direct(42)
    assert out["token"] == 0 and out["lost"] is False
    assert out["key"] == direct.singleton_keys(order_id=42).base


def test_eager_mode_runs_and_leaves_no_lock(redis_server: RedisServer, r):
    app = make_app(redis_server.url(), "eager", conf={"task_always_eager": True})
    res = app.tasks["t.fenced"].delay("k", 0.0, "eager")
    assert res.get()["token"] == 0
    assert r.dbsize() == 0


def test_eager_mode_still_reports_unencodable_arguments():
    """Eager mode builds the key, so a bad argument shows up in the user's tests."""
    app = _unreachable_app()
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    app.conf.task_serializer = "pickle"
    app.conf.accept_content = ["pickle", "json"]

    @app.task(base=SingletonTask, name="t.eager_bad", shared=False)
    def eager_bad(payload: Any) -> None:
        return None

    with pytest.raises(TypeError, match="argument 'payload'"):
        eager_bad.delay(Opaque())


def test_direct_call_inside_running_task_does_not_lock(redis_server, r):
    """A singleton task calling itself as a function does not wait on its own lock."""
    app = make_app(redis_server.url(), "nested", conf={"task_always_eager": True})

    @app.task(base=SingletonTask, bind=True, name="t.nested", shared=False)
    def nested(self: Any, depth: int) -> int:
        return depth if depth == 0 else nested(depth - 1) + 1

    assert nested.delay(3).get() == 3
