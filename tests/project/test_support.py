"""The suite's own helpers: a server started on a free port survives losing that
port to another process before it binds it (Flower, the metrics server, a sentinel)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support import RedisServer, dead_port, serve_on_free_port

SERVE = "import http.server, sys; http.server.test(http.server.SimpleHTTPRequestHandler, " \
        "http.server.ThreadingHTTPServer, port=int(sys.argv[1]), bind='127.0.0.1')"


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_a_server_whose_free_port_was_taken_first_starts_again_on_another(tmp_path: Path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    blocked = taken.getsockname()[1]
    log = tmp_path / "server.log"
    ports: list[int] = []

    def spawn(port: int) -> subprocess.Popen[Any]:
        # the first start finds its port taken, as if another test got there first
        ports.append(blocked if not ports else port)
        return subprocess.Popen([sys.executable, "-c", SERVE, str(ports[-1])], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=log.open("wb"))

    try:
        proc, port = serve_on_free_port(spawn, log.read_text, _answers, what="http.server")
        try:
            assert len(ports) == 2 and port == ports[1] != blocked
            assert _answers(port)
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        taken.close()


def test_a_cluster_node_whose_bus_port_was_taken_first_starts_again_on_others():
    """A cluster node binds two ports: its own and the bus port given with
    ``--cluster-port``; when another process took the bus port, both move."""
    taken = dead_port()
    with RedisServer(["--cluster-enabled", "yes", "--cluster-port", str(taken)]) as node:
        bus = int(node.extra_args[node.extra_args.index("--cluster-port") + 1])
        assert bus != taken and node.client().ping()
        with socket.create_connection(("127.0.0.1", bus), timeout=5):
            pass  # the node listens on its new bus port


def test_a_server_that_exits_for_another_reason_fails_at_once_with_its_output():
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "server.log"

        def spawn(port: int) -> subprocess.Popen[Any]:
            return subprocess.Popen([sys.executable, "-c", "raise SystemExit('no config file')"],
                                    stdout=subprocess.DEVNULL, stderr=log.open("wb"))

        with pytest.raises(AssertionError, match="no config file"):
            serve_on_free_port(spawn, log.read_text, _answers, what="the server", timeout=60)


def test_a_sentinel_whose_free_port_was_taken_first_starts_on_another():
    """Taken by another test's redis-server, which answers there: the sentinel
    is not fooled by it, and moves."""
    from tests.deployments import SentinelProcess

    with RedisServer() as other:
        sentinel = SentinelProcess("mymaster", 1, 1, 1000)
        sentinel.port = other.port
        try:
            sentinel.start()
            assert sentinel.port != other.port
            assert sentinel.client().info("server")["process_id"] == sentinel.proc.pid
            assert "Address already in use" in sentinel.log.read_text()  # the first try's
        finally:
            sentinel.cleanup()


def test_a_dead_port_refuses_connections_and_nobody_else_can_take_it():
    port = dead_port()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))


def test_a_missing_service_skips_and_fails_where_ci_requires_every_service():
    """tests.support.missing: a skip naming what is missing; a failure naming it
    where SINGLETON_REQUIRE_SERVICES=1."""
    from tests.support import missing

    with pytest.raises(pytest.skip.Exception, match="no RabbitMQ answers"):
        missing("no RabbitMQ answers on 127.0.0.1:5672", {})
    with pytest.raises(pytest.skip.Exception, match="no RabbitMQ answers"):
        missing("no RabbitMQ answers on 127.0.0.1:5672", {"SINGLETON_REQUIRE_SERVICES": "0"})
    with pytest.raises(pytest.fail.Exception,
                       match="SINGLETON_REQUIRE_SERVICES=1 and no PostgreSQL answers"):
        missing("no PostgreSQL answers on 127.0.0.1:5432", {"SINGLETON_REQUIRE_SERVICES": "1"})
