"""Real redis-server and real `celery worker` processes for the tests.

The servers and workers come from the library's public testing module; what is
here is only this suite's own: its worker app and a proxy that can lose replies.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Optional

import pytest

from celery_singleton_lock.engine.calls import marker_task
from celery_singleton_lock.engine.replies import RECORD_FIELDS, record
from celery_singleton_lock.testing import CeleryWorker, RedisServer, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["REQUIRE_SERVICES", "ROOT", "CuttableProxy", "NotRedis", "RedisServer",
           "ReplyDroppingProxy", "Worker", "dead_port", "free_port", "held_on_another_host",
           "marker", "missing", "owner_field", "owner_record", "serve_on_free_port", "wait_for",
           "write_owner"]

#: where set to 1 (.ci/run sets it), a test whose service or version is missing fails
REQUIRE_SERVICES = "SINGLETON_REQUIRE_SERVICES"


def missing(why: str, env: Optional[Mapping[str, str]] = None) -> NoReturn:
    """A test cannot run here: ``why`` names the service, program or version it
    needs. Skipped, saying so; where SINGLETON_REQUIRE_SERVICES=1 (CI), a
    failure instead, so a machine without it cannot pass unnoticed. The
    README says which tests may skip."""
    if (os.environ if env is None else env).get(REQUIRE_SERVICES) == "1":
        pytest.fail(f"{REQUIRE_SERVICES}=1 and {why}", pytrace=False)
    pytest.skip(why)


def installed(module: str, extra: str) -> Any:
    """``module`` imported, or :func:`missing` naming it and the extra (or
    package) that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"{module} is not installed ({extra})")


#: the sockets behind dead_port(), bound for as long as this process lives
_HELD: list[socket.socket] = []


def dead_port() -> int:
    """A loopback port where a connection is refused for as long as the tests run:
    bound here and never listened on, so no other process can take it."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    _HELD.append(held)
    return int(held.getsockname()[1])


def serve_on_free_port(spawn: Callable[[int], subprocess.Popen[Any]], log: Callable[[], str],
                       ready: Callable[[int], Any], what: str, timeout: float = 30,
                       port: Optional[int] = None) -> tuple[subprocess.Popen[Any], int]:
    """A server process on a free port (``port`` first, if given), once
    ``ready(port)``: (the process, its port).

    A port free when picked can be taken before the server binds it (the tests
    run in parallel, and every client connection takes a port too): a server
    that exits saying its address is in use starts again on another port; one
    that exits for another reason fails at once, with what it logged.
    """
    for attempt in range(3):
        port = port if attempt == 0 and port else free_port()
        proc = spawn(port)
        if wait_for(lambda p=proc, n=port: "exited"  # type: ignore[misc]
                    if p.poll() is not None else ready(n), timeout, what=what) != "exited":
            return proc, port
        text = log()
        if "Address already in use" not in text:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}):\n"
                                 f"{text[-3000:]}")
    raise AssertionError(f"{what}: three free ports in a row were taken first")


def owner_record(client: Any, lock_key: str) -> dict[str, str]:
    """A lock's owner record (docs/redis-keys.md), empty when the key is free."""
    return record(client.get(lock_key))


def owner_field(client: Any, lock_key: str, field: str) -> Optional[str]:
    return owner_record(client, lock_key).get(field)


def marker(client: Any, key: str) -> Optional[tuple[str, str]]:
    """A send-time or done marker as (task name, task id); None when absent."""
    value = client.get(key)
    return None if value is None else marker_task(value)


def write_owner(client: Any, lock_key: str, **fields: Any) -> None:
    """Write (or change fields of) an owner record, keeping the key's TTL. A
    ``pid`` given without a ``hostkey`` on a record of this host names that
    process as it would write itself: with its start time (none for a pid no
    process has)."""
    from celery_singleton_lock.process import HOST_KEY, split_host_key, start_ticks

    current = owner_record(client, lock_key)
    if "pid" in fields and "hostkey" not in fields and split_host_key(
            current.get("hostkey", ""))[0] == HOST_KEY:
        started = start_ticks(int(fields["pid"]))
        fields["hostkey"] = f"{HOST_KEY}:{started}" if started else HOST_KEY
    if "at" in current:
        current["at"] += "000"
    current.update({k: str(v) for k, v in fields.items()})
    client.set(lock_key, "\n".join(current.get(f, "") for f in RECORD_FIELDS),
               keepttl=bool(client.exists(lock_key)))


def pid_gone_here() -> int:
    """A pid no process on this machine has: one that just exited (and was reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    return int(proc.stdout)


def held_on_another_host(client: Any, lock_key: str, host: str = "w1@other-machine") -> int:
    """Make a held lock's owner record the one a worker on a second machine
    writes: that machine's host key (its own boot id; docs/redis-keys.md), its
    host name, and the pid of its worker child, which here names no process
    (the case where a local pid lookup would wrongly say "dead"). The key's TTL
    is kept. Returns that pid."""
    from celery_singleton_lock.process import HOST_KEY, pid_alive

    pid = pid_gone_here()
    assert not pid_alive(pid), "the pid must name no process here"
    other = f"{uuid.uuid4()}:4026531836"
    assert other != HOST_KEY
    write_owner(client, lock_key, hostkey=other, host=host, pid=pid)
    return pid


def discard(worker: CeleryWorker) -> None:
    """The test's checks are done: kill -9 the worker and its children.

    A warm shutdown of an idle prefork worker waits about 1.7 s in billiard's
    pool join (plain Celery's own, the same with or without this library);
    a test that checks nothing more need not wait for it. Tests of a warm or
    cold shutdown send their signal themselves.
    """
    worker.stop(timeout=0)


class Worker(CeleryWorker):
    """`celery -A tests.workerapp worker` as a subprocess, configured by env vars."""

    def __init__(self, redis_url: str, queue: str, *, pool: str = "prefork",
                 concurrency: int = 2, conf: Optional[dict[str, Any]] = None,
                 lock_url: Optional[str] = None, name: Optional[str] = None,
                 extra_args: Optional[list[str]] = None) -> None:
        env = {
            "SLT_REDIS_URL": redis_url,
            "SLT_LOCK_URL": lock_url or "",
            "SLT_QUEUE": queue,
            "SLT_CONF": json.dumps(conf or {}),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        super().__init__("tests.workerapp:app", queue, pool=pool, concurrency=concurrency,
                         env=env, cwd=str(ROOT), name=name, extra_args=extra_args or ())


class NotRedis:
    """A loopback server that answers but is not Redis: whatever it is sent, it
    replies as an HTTP server does to a request it cannot parse."""

    REPLY = b"HTTP/1.1 400 Bad Request\r\nServer: nginx\r\nContent-Length: 0\r\n\r\n"

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    def _answer(self, client: socket.socket) -> None:
        with client, contextlib.suppress(OSError):
            while client.recv(65536):
                client.sendall(self.REPLY)

    def close(self) -> None:
        self.listener.close()


class _Proxy:
    """A TCP proxy to a local Redis: one thread per direction per connection."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            state = {"drop": False}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state),
                             daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        self._pipe(client, upstream)

    def _down(self, upstream: socket.socket, client: socket.socket,
              state: dict[str, bool]) -> None:
        self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


class ReplyDroppingProxy(_Proxy):
    """A proxy that can lose one reply: the command reaches Redis and runs, then
    the client's connection breaks before the answer arrives (``drops_left``
    set above 1 with ``drop_after``: the replies to that many writes holding
    it, on whichever connections they come)."""

    def __init__(self, target_port: int) -> None:
        self.drop_after: Optional[bytes] = None  # drop the reply to the next command with this
        self.drops_left = 0
        self.dropped = 0
        self._lock = threading.Lock()
        super().__init__(target_port)

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self.drop_after is not None and self.drop_after in data:
                        self.drops_left -= 1
                        if self.drops_left <= 0:
                            self.drop_after = None
                        state["drop"] = True
                upstream.sendall(data)

    def _down(self, upstream: socket.socket, client: socket.socket,
              state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if state["drop"]:
                    self.dropped += 1
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    upstream.close()
                    return
                client.sendall(data)


class PausableProxy(_Proxy):
    """A proxy whose forwarding can be stopped and resumed: the connections stay
    open, bytes just stop flowing (a paused network path)."""

    def __init__(self, target_port: int) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        super().__init__(target_port)

    def pause(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


class CuttableProxy(_Proxy):
    """A proxy (to any TCP server: Redis, RabbitMQ) whose connections can all
    be broken at once, a lost network path: while cut, a new connection is
    closed as soon as it is made."""

    def __init__(self, target_port: int) -> None:
        self.is_cut = False
        self._open: list[socket.socket] = []
        self._guard = threading.Lock()
        super().__init__(target_port)

    def cut(self) -> None:
        with self._guard:
            self.is_cut = True
            broken, self._open = self._open, []
        for sock in broken:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        with self._guard:
            if not self.is_cut:
                self._open += [client, upstream]
        if self.is_cut:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()
            return
        self._pipe(client, upstream)


class HoldLoad:
    """Calls of ``t.hold`` over some keys, one every ``every`` seconds, run by
    :meth:`step` from the test's own loop; each result kept with the moment
    the worker decided it (its ``date_done``, the worker's wall clock, as the
    events' times)."""

    def __init__(self, hold: Any, keys: list[str], seed: int, every: float = 0.05,
                 seconds: tuple[float, float] = (0.1, 0.5), tag: str = "load") -> None:
        import random

        self.hold, self.keys, self.rng = hold, keys, random.Random(seed)
        self.every, self.seconds, self.tag = every, seconds, tag
        self.pending: list[Any] = []
        self.ready: list[tuple[Any, float]] = []
        #: each call's key, by task id
        self.key_of: dict[str, str] = {}
        self._next = 0.0

    def step(self, sending: bool = True) -> None:
        now = time.monotonic()
        if sending and now >= self._next:
            self._next = now + self.every
            key = self.rng.choice(self.keys)
            res = self.hold.delay(key, self.rng.uniform(*self.seconds), self.tag)
            self.key_of[res.id] = key
            self.pending.append(res)
        still = []
        for res in self.pending:
            if res.ready():
                done = res.date_done
                self.ready.append((res, done.timestamp() if done is not None else time.time()))
            else:
                still.append(res)
        self.pending = still
        time.sleep(0.01)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            self.step(sending=False)
        assert not self.pending, f"{len(self.pending)} calls not final"

    def skips(self) -> list[tuple[dict[str, Any], float]]:
        """Every skipped call's result, with when it was decided."""
        from celery_singleton_lock import is_skipped

        return [(res.result, at) for res, at in self.ready if is_skipped(res.result)]

    def late_skips(self, ends: dict[str, float], after: float, slack: float = 1.0
                   ) -> list[float]:
        """Seconds past the holder's end of every skip decided more than
        ``slack`` after both the holder ended and ``after`` (a promotion, a
        healed path: releases owed meanwhile are on their way then)."""
        late = []
        for result, at in self.skips():
            if result["holder"] in ends:
                ended = ends[result["holder"]]
                if at > ended + slack and at > after + slack:
                    late.append(at - ended)
        return late

    def never_ran(self, started: set[str]) -> list[str]:
        """The holders named by skips that never started at all."""
        return [r["holder"] for r, _ in self.skips() if r["holder"] not in started]

    def skips_while_not_running(self, events: list[dict[str, Any]], after: float,
                                slack: float = 1.0) -> list[str]:
        """Every skip decided while its holder was not running: no run of that
        task id (``events``: the runs' start and end events) around it (the
        start event follows the grant, the release the end event: ``slack``
        either way). One whose holder had not started yet is always wrong (a
        grant nobody held); one whose holder had ended is wrong if it came
        more than ``slack`` after ``after`` too (a fault healed: a release
        owed through it goes out as soon as its process hears the server
        again). Each as text, for a failure's message."""
        runs: dict[str, list[tuple[float, float]]] = {}
        starts: dict[tuple[str, int], float] = {}
        for e in sorted(events, key=lambda e: e["t"]):
            key = (e["id"], e.get("pid", 0))
            if e["ev"] == "start":
                starts[key] = e["t"]
            elif key in starts:
                runs.setdefault(e["id"], []).append((starts.pop(key), e["t"]))
        for (task_id, _), began in starts.items():  # never ended: still running
            runs.setdefault(task_id, []).append((began, float("inf")))
        out = []
        for result, at in self.skips():
            spans = runs.get(result["holder"], [])
            if any(b - slack <= at <= e + slack for b, e in spans):
                continue
            ended = any(e < at for _, e in spans)
            if ended and at <= after + slack:
                continue
            text = ", ".join(f"{b:.3f}-{e:.3f}" for b, e in spans) or "none"
            out.append(f"skip at {at:.3f} against {result['holder']}, "
                       f"{'ended' if ended else 'not started'} (its runs: {text})")
        return out
