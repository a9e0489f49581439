"""The Celery app the benchmark worker runs: one trivial task per configuration.

``celery -A benchmarks.benchapp:app worker``; configured from the environment:
``BENCH_BROKER_URL`` (broker db 0; counters db 3) and ``BENCH_LOCK_URL`` (the
Redis every lock library uses, alone on its server so its commands can be
counted).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, signals

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
LOCK = os.environ.get("BENCH_LOCK_URL", BROKER)
_base = BROKER.rsplit("/", 1)[0]

app = Celery("bench", broker=BROKER, set_as_current=False)
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    task_ignore_result=True,
    worker_prefetch_multiplier=8,
    broker_connection_retry_on_startup=True,
    # celery-singleton-lock
    singleton_redis_url=LOCK,
    # celery-singleton (it reads singleton_backend_url)
    singleton_backend_url=LOCK,
    # celery-once
    ONCE={"backend": "celery_once.backends.Redis",
          "settings": {"url": LOCK, "default_timeout": 3600}},
)

counters = redis.Redis.from_url(f"{_base}/3")


_started: dict[str, float] = {}


@signals.task_prerun.connect(weak=False)
def _start_clock(task_id: str = "", task: Any = None, **_: Any) -> None:
    if task is not None and task.name.startswith("bench.real_"):
        _started[task_id] = time.perf_counter()


@signals.task_postrun.connect(weak=False)
def _count(sender: Any = None, task_id: str = "", task: Any = None, **_: Any) -> None:
    # A task that does work: its time in the pool from prerun to postrun (the
    # lock's acquire and release included), in µs, read before it is sent.
    began = _started.pop(task_id, None)
    if began is not None:
        counters.rpush(f"traced:{task.name}", round((time.perf_counter() - began) * 1e6))
    # Every task that finishes, skipped ones included: how the driver knows a
    # batch is through. The same one command for every configuration.
    counters.incr("processed")


def _trivial(n: int) -> int:
    return n + 1


@app.task(name="bench.plain")
def plain(n: int) -> int:
    return _trivial(n)


# The floor: what any lock taken and freed in the worker costs at the least, one
# bare round trip each way (redis-py, no script, no owner record, no library).
_floor = redis.Redis.from_url(LOCK)


@app.task(name="bench.floor")
def floor(n: int) -> int:
    key = f"bench-floor:{n}"
    _floor.set(key, "1", nx=True, px=60_000)
    try:
        return _trivial(n)
    finally:
        _floor.delete(key)


def _real(n: int, io_seconds: float, cpu_seconds: float) -> int:
    """A task that does work: waits on I/O ``io_seconds`` (a sleep, as a socket
    wait would), then computes until its thread has used ``cpu_seconds`` of CPU
    (CPU time, so a busy machine makes it wait, not do less)."""
    if io_seconds:
        time.sleep(io_seconds)
    acc = n
    if cpu_seconds:
        until = time.thread_time() + cpu_seconds
        while time.thread_time() < until:
            for i in range(1000):
                acc = (acc * 31 + i) % 1_000_003
    return acc


@app.task(name="bench.real_plain")
def real_plain(n: int, io_seconds: float, cpu_seconds: float) -> int:
    return _real(n, io_seconds, cpu_seconds)


@app.task(name="bench.real_floor")
def real_floor(n: int, io_seconds: float, cpu_seconds: float) -> int:
    key = f"bench-floor:real:{n}"
    _floor.set(key, "1", nx=True, px=60_000)
    try:
        return _real(n, io_seconds, cpu_seconds)
    finally:
        _floor.delete(key)


@app.task(name="bench.one_trip")
def one_trip(n: int) -> int:
    """A plain task that asks Redis one thing: what a skip costs at the least."""
    _floor.get("bench-floor:none")
    return _trivial(n)


def _register_ours() -> None:
    from celery_singleton_lock import SingletonTask

    @app.task(name="bench.ours", base=SingletonTask)
    def ours(n: int) -> int:
        return _trivial(n)

    @app.task(name="bench.real_ours", base=SingletonTask)
    def real_ours(n: int, io_seconds: float, cpu_seconds: float) -> int:
        return _real(n, io_seconds, cpu_seconds)

    @app.task(name="bench.storm", base=SingletonTask, bind=True, singleton_key=("key",))
    def storm(self: Any, key: str, seconds: float) -> int:
        active = counters.incr(f"active:{key}")
        try:
            if active > 1:
                counters.incr("overlaps")
            counters.incr("executions")
            time.sleep(seconds)
        finally:
            counters.decr(f"active:{key}")
        return 0


def _register_peers() -> None:
    try:
        from celery_singleton import Singleton
    except ImportError:  # the bench extra is not installed
        Singleton = None
    try:
        from celery_once import QueueOnce
    except ImportError:
        QueueOnce = None
    if Singleton is not None:
        @app.task(name="bench.celery_singleton", base=Singleton)
        def peer_singleton(n: int) -> int:
            return _trivial(n)
    if QueueOnce is not None:
        @app.task(name="bench.celery_once", base=QueueOnce)
        def peer_once(n: int) -> int:
            return _trivial(n)


_register_ours()
_register_peers()
