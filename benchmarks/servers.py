"""Processes the benchmark starts and stops: the library's testing helpers, set
up the way the benchmark needs them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import redis

from celery_singleton_lock.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent


class Redis(RedisServer):
    """A redis-server of the benchmark's own, on a free loopback port."""

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db)  # bytes: the benchmark reads raw replies

    def start(self) -> Redis:
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Worker(CeleryWorker):
    """`celery -A benchmarks.benchapp worker`, prefork unless told, as users run it."""

    def __init__(self, env: dict[str, str], concurrency: int, pool: str = "prefork",
                 queue: Optional[str] = None) -> None:
        env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        super().__init__("benchmarks.benchapp:app", queue or env["BENCH_QUEUE"], pool=pool,
                         concurrency=concurrency, env=env, cwd=str(ROOT),
                         name=f"bench-{pool}-{os.getpid()}@%h", loglevel="WARNING")

    def start(self, wait: bool = False, timeout: float = 30.0) -> Worker:
        super().start(wait=wait, timeout=timeout)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        super().stop(timeout)
        self.log.unlink(missing_ok=True)
