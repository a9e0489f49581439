"""A redelivered copy of a running task (a broker redelivering its message)
marks the lock: its holder records the task's finish when it releases, and
the copy, asked again, is dropped. The mark stays through a retry: the
retried attempt takes back the key its earlier attempt kept and finishes the
task, and the copy is dropped still, on Redis (scripts) and on Valkey (the
native commands and the scripts)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.engine.conftest import PATHS
from tests.support import RedisServer, owner_field

KINDS = {"redis": "off", **{f"valkey-{path}": native for path, native in PATHS.items()}}


@pytest.fixture(params=list(KINDS))
def engine(request: Any, redis_server: RedisServer, valkey: RedisServer
           ) -> Iterator[tuple[LockEngine, RedisServer]]:
    server = redis_server if request.param == "redis" else valkey
    e = connect(dataclasses.replace(SingletonConfig.defaults(server.url(2)),
                                    native=KINDS[request.param]))
    assert isinstance(e, LockEngine)
    assert (e.path.native is not None) == (request.param == "valkey-native")
    yield e, server
    e.close()


def take(engine: LockEngine, keys: LockKeys, exec_id: str, retries: int = 0,
         slots: int = 1) -> Any:
    return engine.acquire(keys, Request("task-a", exec_id, Lease.of_ms(30_000), "w1@host",
                                        retries, "t.x", slots=slots))


@pytest.mark.parametrize("slots", [1, 2])
def test_a_copy_seen_before_a_retry_is_dropped_once_the_retry_finished(
        engine: tuple[LockEngine, RedisServer], slots: int) -> None:
    """The copy asks while the first attempt runs, and again only once the
    retried attempt finished: it is dropped, not run a second time. (Before,
    the retry's take-back wrote a fresh record without the mark, its release
    left no finish marker, and the copy was granted and ran the task again.)
    Under a limit of two the same, in the slot the attempt kept."""
    lock, server = engine
    r = server.client(2)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    slot = keys.slot(1)
    assert take(lock, keys, "exec-a", slots=slots).status is Acquire.GRANTED
    copy = take(lock, keys, "exec-copy", slots=slots)
    assert copy.status is Acquire.SAME_TASK and copy.holder.exec_id == "exec-a"
    assert owner_field(r, slot.lock, "copies") == "1"
    assert lock.hand_off(slot, "exec-a", 1, 30_000) is True  # the task retries
    assert take(lock, keys, "exec-a2", retries=1, slots=slots).status is Acquire.GRANTED
    mark = owner_field(r, slot.lock, "copies")
    assert lock.release(slot, "exec-a2", "task-a") is True
    # the copy asks again only now: the task finished, it is dropped
    assert take(lock, keys, "exec-copy", slots=slots).status is Acquire.FINISHED
    assert (mark, r.get(slot.fin)) == ("1", "task-a")
