"""Where a process's counts are written: to the lock Redis of the engine that
counted them, whichever engines the process made before."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
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
