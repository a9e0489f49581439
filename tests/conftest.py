from __future__ import annotations

import gc
import json
import uuid
from typing import Any, Iterator

import celery
import pytest
import redis

from tests.support import RedisServer, Worker, discard
from tests.workerapp import make_app

_CELERY_BEFORE_5_7 = tuple(int(x) for x in celery.__version__.split(".")[:2]) < (5, 7)


@pytest.fixture(autouse=True)
def _no_collector_inside_a_send() -> Iterator[None]:
    """Celery before 5.7: the garbage collector finalizing an AsyncResult in
    the middle of the Redis result backend's SUBSCRIBE hangs the caller for
    ever (celery/celery#10477, Celery's, fixed in 5.7). The test process is
    such a caller: its cyclic collector runs between tests only."""
    if not _CELERY_BEFORE_5_7:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server of our own for the session (never the machine's)."""
    server = RedisServer().start()
    yield server
    # results still referenced unsubscribe while the server is up: on Celery
    # 5.3 one that does so at exit retries its connection for minutes
    gc.collect()
    server.cleanup()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server for one test, free to stop and start."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def r(redis_server: RedisServer) -> redis.Redis:
    """db 2 (the locks) of the session server, emptied before the test."""
    client = redis_server.client(2)
    client.flushdb()
    return client


@pytest.fixture
def key() -> str:
    return uuid.uuid4().hex[:12]


class Events:
    def __init__(self, server: RedisServer) -> None:
        self.client = server.client(3)

    def all(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.client.lrange("events", 0, -1)]

    def starts(self, tag_prefix: str = "") -> list[dict[str, Any]]:
        return [e for e in self.all() if e["ev"] == "start" and e["tag"].startswith(tag_prefix)]

    def ends(self, tag_prefix: str = "") -> list[dict[str, Any]]:
        return [e for e in self.all() if e["ev"] == "end" and e["tag"].startswith(tag_prefix)]


@pytest.fixture
def events(redis_server: RedisServer) -> Events:
    ev = Events(redis_server)
    ev.client.delete("events")
    return ev


@pytest.fixture(scope="module")
def prefork_worker(redis_server: RedisServer) -> Iterator[Worker]:
    """A prefork worker with 3 processes shared by a module's tests."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, concurrency=3).start()
    yield worker
    discard(worker)


@pytest.fixture(scope="module")
def client_app(redis_server: RedisServer, prefork_worker: Worker) -> Any:
    """The caller's side of `prefork_worker`: same tasks, same queue."""
    return make_app(redis_server.url(), prefork_worker.queue)
