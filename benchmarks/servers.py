"""Processes the benchmark starts and stops: redis-server and a Celery worker."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """A redis-server of the benchmark's own, on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db)

    def start(self) -> Redis:
        # the system's server first: a Python package may put another on PATH
        binary = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin") or shutil.which(
            "redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Worker:
    """`celery -A benchmarks.benchapp worker`, prefork, as users run it."""

    def __init__(self, env: dict[str, str], concurrency: int) -> None:
        self.log = Path(tempfile.mkstemp(prefix="bench-worker-", suffix=".log")[1])
        self.env = dict(env)
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        self.cmd = [
            sys.executable, "-m", "celery", "-A", "benchmarks.benchapp:app", "worker",
            "-P", "prefork", "-c", str(concurrency), "-Q", env["BENCH_QUEUE"],
            "-n", f"bench-{os.getpid()}@%h", "--loglevel", "WARNING", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-f", str(self.log),
        ]
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> Worker:
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.log.unlink(missing_ok=True)
