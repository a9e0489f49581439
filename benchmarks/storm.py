"""Duplicate storm: deliveries of a few keys, (a) every key held elsewhere, so
each one is a skip, against plain tasks and plain tasks asking Redis one GET;
(b) bursts of real 5 ms executions racing on a key, counting overlaps."""

from __future__ import annotations

import statistics
import uuid

from celery_singleton_lock.engine.request import Lease, Request

from .harness import Bench


def measure(bench: Bench) -> None:
    from celery_singleton_lock.engine.registry import engine_for

    storm = bench.app.tasks["bench.storm"]
    plain = bench.app.tasks["bench.plain"]
    n, k = bench.sizes.storm, bench.sizes.storm_keys
    keys = [f"account-{i}" for i in range(k)]
    # (a) the skip path alone: every key held by a long execution elsewhere
    engine = engine_for(bench.app)
    held = []
    for key in keys:
        lk = storm.singleton_keys(key, 0.0)
        engine.acquire(lk, Request(task_id=f"holder-{key}", exec_id=uuid.uuid4().hex,
                                   lease=Lease.of_ms(600_000), hostname="elsewhere", retries=0,
                                   task_name=storm.name))
        held.append(lk)
    one_trip = bench.app.tasks["bench.one_trip"]
    skip_times, plain_times, trip_times = [], [], []
    kinds = ("skipped duplicate", "plain task", "plain task + one GET")
    cpu: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
    rounds = max(1, min(3, bench.sizes.rounds - 2))
    for _ in range(rounds):
        bench.counters.set("executions", 0)
        skip_times.append(bench.costed_batch(lambda i: storm.delay(keys[i % k], 0.0), n,
                                            cpu[kinds[0]]))
        assert int(bench.counters.get("executions") or 0) == 0
        plain_times.append(bench.costed_batch(lambda i: plain.delay(i), n, cpu[kinds[1]]))
        trip_times.append(bench.costed_batch(lambda i: one_trip.delay(i), n, cpu[kinds[2]]))
    for lk in held:
        bench.lock_client.delete(lk.lock)
    # (b) real executions racing: bursts of duplicates of one key, each run
    # 5 ms, so the worker's processes keep meeting each other on a key
    bench.counters.set("overlaps", 0)
    bench.counters.set("executions", 0)
    mixed = bench.batch(lambda i: storm.delay(keys[(i // 25) % k], 0.005), n)
    executions = int(bench.counters.get("executions") or 0)
    bench.results["storm"] = {
        "deliveries": n,
        "keys": k,
        "skip_tasks_per_s": n / statistics.median(skip_times),
        "plain_tasks_per_s": n / statistics.median(plain_times),
        "one_trip_tasks_per_s": n / statistics.median(trip_times),
        "cpu_us_per_delivery": {kind: {role: v / (n * rounds) * 1e6
                                       for role, v in per.items()}
                                for kind, per in cpu.items()},
        "racing_seconds": mixed,
        "racing_executions": executions,
        "racing_skipped": n - executions,
        "overlapping_executions": int(bench.counters.get("overlaps") or 0),
    }
