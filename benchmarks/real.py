"""Tasks that do work (5 ms of I/O, 20 ms of CPU) in a prefork and a thread
pool: plain Celery, ours and the floor, paired by round, with the time each
task spends in the pool (``task_prerun`` to ``task_postrun``)."""

from __future__ import annotations

import random
import statistics
from typing import Any

from .harness import CPU_ROLES, FLOOR, Bench, percentile

# tasks that do work: (label, seconds of I/O, milliseconds of CPU)
REAL_KINDS = (("5 ms I/O", 0.005, 0.0), ("20 ms CPU", 0.0, 20.0))
REAL_POOLS = ("prefork", "threads")
REAL_CONFIGS = (("plain Celery", "bench.real_plain"),
                ("celery-singleton-lock", "bench.real_ours"),
                (FLOOR, "bench.real_floor"))


def measure(bench: Bench) -> None:
    assert bench.threads is not None
    pools = {"prefork": (bench.worker, bench.app.conf.task_default_queue),
             "threads": (bench.threads, bench.threads.queue)}
    plain = bench.app.tasks["bench.real_plain"]
    for _worker, queue in pools.values():  # warm up; the thread pool has booted by then
        def warm(i: int, queue: str = queue) -> Any:
            return plain.apply_async((-1 - i, 0.0, 0), queue=queue)

        bench.batch(warm, max(20, bench.sizes.real_io))
    cases = [(kind, pool, label) for kind, _, _ in REAL_KINDS for pool in REAL_POOLS
             for label, _ in REAL_CONFIGS]
    times: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
    cpu: dict[tuple[str, str, str], dict[str, float]] = {c: {} for c in cases}
    traced: dict[tuple[str, str, str], list[int]] = {c: [] for c in cases}
    names = dict(REAL_CONFIGS)
    for name in names.values():
        bench.counters.delete(f"traced:{name}")
    work = {kind: (io, ms / 1000) for kind, io, ms in REAL_KINDS}
    offset = 0
    for _ in range(bench.sizes.real_rounds):
        order = cases[:]
        random.shuffle(order)
        for case in order:
            kind, pool, label = case
            n = bench.sizes.real_io if work[kind][0] else bench.sizes.real_cpu
            task = bench.app.tasks[names[label]]
            worker, queue = pools[pool]
            io, cpu_s = work[kind]

            def send(i: int, task: Any = task, base: int = offset, io: float = io,
                     cpu_s: float = cpu_s, queue: str = queue) -> Any:
                return task.apply_async((base + i, io, cpu_s), queue=queue)

            times[case].append(bench.costed_batch(send, n, cpu[case], worker=worker))
            offset += n
            key = f"traced:{names[label]}"
            traced[case] += [int(x) for x in bench.counters.lrange(key, 0, -1)]
            bench.counters.delete(key)
    rows = []
    for kind, _, _ in REAL_KINDS:
        n = bench.sizes.real_io if work[kind][0] else bench.sizes.real_cpu
        for pool in REAL_POOLS:
            base = times[(kind, pool, "plain Celery")]
            floor = times[(kind, pool, FLOOR)]
            plain_traced = statistics.median(traced[(kind, pool, "plain Celery")])
            for label, _ in REAL_CONFIGS:
                mine = times[(kind, pool, label)]
                ratios = [x / p for x, p in zip(mine, base)]
                vs_floor = [x / f for x, f in zip(mine, floor)]
                rows.append({
                    "task": kind, "pool": pool, "config": label,
                    "tasks_per_batch": n,
                    "batch_seconds": mine,
                    "tasks_per_s": n / statistics.median(mine),
                    "time_ratio": statistics.median(ratios),
                    "time_ratios": ratios,
                    "floor_ratio": statistics.median(vs_floor),
                    "floor_ratios": vs_floor,
                    # prerun to postrun in the pool, every task of every round
                    "pool_us_median": statistics.median(traced[(kind, pool, label)]),
                    "pool_us_p90": percentile(
                        [float(x) for x in traced[(kind, pool, label)]], 0.9),
                    "pool_us_over_plain": statistics.median(traced[(kind, pool, label)])
                    - plain_traced,
                    "pool_samples": len(traced[(kind, pool, label)]),
                    "cpu_us_per_task": {
                        role: cpu[(kind, pool, label)].get(role, 0.0)
                        / (n * bench.sizes.real_rounds) * 1e6 for role in CPU_ROLES},
                })
    bench.results["real"] = {"rounds": bench.sizes.real_rounds,
                            "worker_concurrency": bench.sizes.concurrency, "rows": rows}
