"""Where a process's counts and held locks are written: to the lock Redis of
the engine that counted or holds them, whichever engines the process made
before."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.observe import monitor
from celery_singleton_lock.observe.monitor import read_counts
from celery_singleton_lock.testing import RedisServer


@pytest.fixture
def publisher() -> Iterator[monitor.Publisher]:
    """The process's publisher, emptied before and after (its thread writes
    once a second: the test flushes itself, so the thread finds nothing)."""
    monitor.PUBLISHER.reset()
    yield monitor.PUBLISHER
    monitor.PUBLISHER.reset()


def counted(engine: Any) -> dict[tuple[str, str], float]:
    """(counter, task) -> count, as ``engine``'s lock Redis holds them."""
    return {(counter, task): value for counter, task, _host, _reason, value
            in read_counts(engine, engine.config.key_prefix)}


def test_two_deployments_in_one_process_each_get_their_own_counts(
        publisher: monitor.Publisher) -> None:
    """A caller with two apps (two lock Redis servers) counts refusals on
    both: each server's counters hold its own app's only, and the engine
    with nothing left to write is let go. (Before, every count went to the
    first engine the process counted with.)"""
    with RedisServer() as first_server, RedisServer() as second_server:
        first = connect(SingletonConfig.defaults(first_server.url(2)))
        second = connect(SingletonConfig.defaults(second_server.url(2)))
        try:
            monitor.count(first, "refused", "t.first", "duplicate")
            monitor.count(second, "refused", "t.second", "duplicate")
            monitor.count(second, "refused", "t.second", "duplicate")
            monitor.count(None, "lost", "t.lost")  # no engine: the first one's
            publisher.flush()
            on_first, on_second = counted(first), counted(second)
            assert on_first == {("refused", "t.first"): 1, ("lost", "t.lost"): 1}, on_first
            assert on_second == {("refused", "t.second"): 2}, on_second
            assert id(second) not in publisher._engines  # nothing left for it
            monitor.count(second, "refused", "t.second", "duplicate")
            publisher.flush()
            assert counted(second) == {("refused", "t.second"): 3}
        finally:
            first.close()
            second.close()


@pytest.fixture
def own_publisher(monkeypatch: pytest.MonkeyPatch) -> monitor.Publisher:
    """A publisher of the test's own as the process's, whose thread never
    starts (a thread that is not started stands in for it): only the test's
    flushes write, none races them with a snapshot of before."""
    publisher = monitor.Publisher()
    publisher._thread = threading.Thread(target=lambda: None)
    monkeypatch.setattr(monitor, "PUBLISHER", publisher)
    return publisher


class Held:
    """What a worker's renewer hands the publisher (``Heartbeat.held``): the
    locks this process holds through one engine now."""

    def __init__(self) -> None:
        self.locks: list[SingletonLock] = []

    def __call__(self) -> list[SingletonLock]:
        return list(self.locks)


def holding(prefix: str, task_id: str) -> SingletonLock:
    return SingletonLock(LockKeys(prefix, uuid.uuid4().hex), task_id=task_id,
                         task_name="t.hold", token=1, lease=300.0,
                         started=time.monotonic(), held=True)


def held_entries(engine: Any) -> dict[str, list[str]]:
    """This deployment's held-locks hash, as Redis has it (stale or not):
    field -> the task ids of its locks."""
    raw = engine.read_hash(monitor.held_key(engine.config.key_prefix))
    return {field: [lock["id"] for lock in json.loads(value)["locks"]]
            for field, value in raw.items()}


@pytest.mark.parametrize("layout", ["two servers", "two prefixes"])
def test_each_deployments_held_locks_entry_goes_when_its_locks_end(
        own_publisher: monitor.Publisher, layout: str) -> None:
    """A worker process holding locks of two deployments (two lock Redis
    servers, or two key prefixes on one) publishes each one's held locks to
    its own hash, and removes each entry at the first flush after that
    deployment's last lock ended: the second deployment's as well as the
    first's (where counts of no engine go), not left for the hash's TTL
    to end; and a deployment whose entry went shows its locks again when it
    holds again."""
    with contextlib.ExitStack() as stack:
        first_server = stack.enter_context(RedisServer())
        second_server = (first_server if layout == "two prefixes"
                         else stack.enter_context(RedisServer()))
        first = connect(SingletonConfig.defaults(first_server.url(2)))
        second = connect(SingletonConfig.defaults(second_server.url(2),
                                                  key_prefix="other:"))
        first_held, second_held = Held(), Held()
        field = f"{monitor.NODE.hostname}|{os.getpid()}"
        try:
            monitor.count(first, "acquired", "t.hold")  # the first engine counted with
            monitor.count(second, "acquired", "t.hold")
            own_publisher.held_from(first, first_held)
            own_publisher.held_from(second, second_held)
            first_held.locks = [holding("singleton:", "a")]
            second_held.locks = [holding("other:", "b")]
            own_publisher.flush()
            assert held_entries(first) == {field: ["a"]}
            assert held_entries(second) == {field: ["b"]}

            second_held.locks = []  # the second deployment's last lock ended
            own_publisher.flush()
            assert held_entries(second) == {}  # now, not when the hash expires
            assert held_entries(first) == {field: ["a"]}
            own_publisher.flush()  # nothing to write for the second: still nothing
            assert held_entries(second) == {}

            second_held.locks = [holding("other:", "c")]  # it holds again: shown
            own_publisher.flush()
            assert held_entries(second) == {field: ["c"]}
            second_held.locks = []
            own_publisher.flush()
            assert held_entries(second) == {}

            first_held.locks = []  # and the first's goes the same way
            own_publisher.flush()
            assert held_entries(first) == {}
            assert held_entries(second) == {}
        finally:
            first.close()
            second.close()


def test_a_renewer_registered_during_a_flush_has_its_held_locks_published(
        own_publisher: monitor.Publisher, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's renewer of a second deployment registers with the publisher
    while a flush is writing (its first lock taken meanwhile): the flush
    began with nothing to hold for that engine, but the engine is kept, and
    the next flush publishes its held lock. (Before, the flush's end forgot
    the engine as having nothing left to write, and its held locks were not
    published until the process counted with it again: never, for one long
    task.)"""
    with RedisServer() as server:
        first = connect(SingletonConfig.defaults(server.url(2)))
        second = connect(SingletonConfig.defaults(server.url(2), key_prefix="other:"))
        second_held = Held()
        second_held.locks = [holding("other:", "b")]
        field = f"{monitor.NODE.hostname}|{os.getpid()}"
        try:
            monitor.count(first, "acquired", "t.hold")  # the first engine counted with
            monitor.count(second, "acquired", "t.hold")
            real = first.update_hash
            registered = []

            def writing(*args: Any, **kw: Any) -> Any:
                if not registered:  # the renewer of the second registers now
                    own_publisher.held_from(second, second_held)
                    registered.append(True)
                return real(*args, **kw)

            monkeypatch.setattr(first, "update_hash", writing)
            own_publisher.flush()
            assert registered
            assert id(second) in own_publisher._engines
            own_publisher.flush()
            assert held_entries(second) == {field: ["b"]}
        finally:
            first.close()
            second.close()
