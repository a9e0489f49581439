"""Real redis-server and real `celery worker` processes for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """A redis-server of our own on a free loopback port; safe to FLUSHALL."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="slt-redis-")
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, decode_responses=True)

    def start(self) -> RedisServer:
        # the system's server first: a Python package may put another on PATH
        binary = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin") or shutil.which(
            "redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self._ping, 10, what=f"redis-server on port {self.port}")
        return self

    def _ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Worker:
    """`celery -A tests.workerapp worker` as a subprocess, as users run it."""

    def __init__(self, redis_url: str, queue: str, *, pool: str = "prefork",
                 concurrency: int = 2, conf: Optional[dict[str, Any]] = None,
                 lock_url: Optional[str] = None, name: Optional[str] = None,
                 extra_args: Optional[list[str]] = None) -> None:
        self.queue = queue
        self.name = name or f"{queue}-{os.getpid()}-{time.monotonic_ns()}@%h"
        self.log = Path(tempfile.mkstemp(prefix=f"slt-worker-{queue}-", suffix=".log")[1])
        self.env = dict(os.environ)
        self.env.update({
            "SLT_REDIS_URL": redis_url,
            "SLT_LOCK_URL": lock_url or "",
            "SLT_QUEUE": queue,
            "SLT_CONF": json.dumps(conf or {}),
            "PYTHONPATH": os.pathsep.join([str(ROOT), self.env.get("PYTHONPATH", "")]),
        })
        self.cmd = [
            sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "worker",
            "-P", pool, "-c", str(concurrency), "-Q", queue, "-n", self.name,
            "--loglevel", "INFO", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-f", str(self.log), *(extra_args or []),
        ]
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self, wait: bool = True) -> Worker:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=str(ROOT), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        if wait:
            wait_for(lambda: "ready." in self.logs() or self.proc.poll() is not None,  # type: ignore[union-attr]
                     30, what="worker ready")
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.output()}\n{self.logs()}")
        return self

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def output(self) -> str:
        if self.proc is None or self.proc.stdout is None:
            return ""
        if self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill_all(self) -> None:
        """kill -9 the whole worker: main process and every child."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
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


class ReplyDroppingProxy:
    """A TCP proxy to a Redis that can lose one reply: the command reaches Redis
    and runs, then the client's connection breaks before the answer arrives."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = int(self.listener.getsockname()[1])
        self.drop_after: Optional[bytes] = None  # drop the reply to the next command with this
        self.dropped = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            state = {"drop": False}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state),
                             daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self.drop_after is not None and self.drop_after in data:
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

    def close(self) -> None:
        self.listener.close()
