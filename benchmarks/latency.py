"""Acquire/release latency of the lock engine alone against redis-py's
``Lock``, on loopback, in blocks that alternate (p50 and p99)."""

from __future__ import annotations

import time

from celery_singleton_lock.engine.request import Lease, Request

from .harness import Bench, percentile


def measure(bench: Bench) -> None:
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.server import LockEngine
    from celery_singleton_lock.keys import LockKeys

    engine = LockEngine.from_config(SingletonConfig.defaults(bench.locks.url(6)))
    client = bench.locks.client(6)
    ours_keys = LockKeys("bench:", "f" * 32)
    samples: dict[str, dict[str, list[float]]] = {
        "celery-singleton-lock": {"acquire": [], "release": []},
        "redis-py Lock": {"acquire": [], "release": []},
    }
    clock = time.perf_counter

    def ours(i: int) -> tuple[float, float]:
        t0 = clock()
        got = engine.acquire(ours_keys, Request(task_id=f"t{i}", exec_id=f"e{i}",
                                                lease=Lease.of_ms(30_000), hostname="bench",
                                                retries=0,
                                                task_name="bench"))
        t1 = clock()
        engine.release(ours_keys, f"e{i}", f"t{i}")
        t2 = clock()
        assert got.status == 1
        return t1 - t0, t2 - t1

    def redis_py(i: int) -> tuple[float, float]:
        lock = client.lock("bench:redis-py", timeout=30)
        t0 = clock()
        assert lock.acquire(blocking=False)
        t1 = clock()
        lock.release()
        t2 = clock()
        return t1 - t0, t2 - t1

    for i in range(50):  # warm up: scripts loaded, connections open
        ours(i)
        redis_py(i)
    block = 250
    for start in range(0, bench.sizes.latency, block):
        for name, fn in (("celery-singleton-lock", ours), ("redis-py Lock", redis_py)):
            for i in range(start, min(start + block, bench.sizes.latency)):
                a, r = fn(i)
                samples[name]["acquire"].append(a)
                samples[name]["release"].append(r)
    client.flushdb()
    bench.results["latency"] = {
        name: {op: {"p50_us": percentile(v, 0.5) * 1e6, "p99_us": percentile(v, 0.99) * 1e6}
               for op, v in ops.items()}
        for name, ops in samples.items()
    }
