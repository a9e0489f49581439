"""Throughput and Redis cost per task: trivial tasks in batches, plain Celery
beside ours, the peers and the floor, alternated within each round; every
process's CPU per task, and the lock Redis's commands (``INFO commandstats``)
and round trips (``MONITOR``)."""

from __future__ import annotations

import functools
import random
import statistics
from collections import Counter
from typing import Any, Callable

from .harness import CPU_ROLES, FLOOR, SETUP_COMMANDS, Bench, commandstats, delta, version

CONFIGS = [
    ("plain Celery", "bench.plain", "celery"),
    ("celery-singleton-lock", "bench.ours", "celery-singleton-lock"),
    ("celery-singleton", "bench.celery_singleton", "celery-singleton"),
    ("celery-once", "bench.celery_once", "celery-once"),
    # no library: SET NX + DEL in the task body, the least a worker-side lock costs
    (FLOOR, "bench.floor", "redis"),
]
PEERS = ("celery-singleton", "celery-once")


def sender(task: Any, base: int) -> Callable[[int], Any]:
    """Sends task number ``i`` of a batch, with arguments no other batch uses."""
    return lambda i: task.delay(base + i)


def available(bench: Bench) -> list[tuple[str, str, str]]:
    return [c for c in CONFIGS if c[1] in bench.app.tasks]


def measure(bench: Bench) -> None:
    configs = available(bench)
    plain = bench.app.tasks["bench.plain"]
    bench.batch(lambda i: plain.delay(-i), max(50, bench.sizes.tasks // 4))  # warm up
    times: dict[str, list[float]] = {c[0]: [] for c in configs}
    cpu: dict[str, dict[str, float]] = {c[0]: dict.fromkeys(CPU_ROLES, 0.0) for c in configs}
    lock_cmds: dict[str, dict[str, int]] = {c[0]: {} for c in configs}
    keys_left: dict[str, int] = {c[0]: 0 for c in configs}
    send_times: dict[str, list[float]] = {c[0]: [] for c in configs}
    round_cpu: dict[str, list[dict[str, float]]] = {c[0]: [] for c in configs}
    broker_cmds: dict[str, dict[str, int]] = {c[0]: {} for c in configs}
    n = bench.sizes.tasks
    offset = 0
    for _ in range(bench.sizes.rounds):
        order = configs[:]
        random.shuffle(order)
        for label, name, _dist in order:
            task = bench.app.tasks[name]
            lock_before = commandstats(bench.lock_client)
            broker_before = commandstats(bench.broker.client())
            base = offset
            keys_before = bench.lock_keys()
            spent: dict[str, float] = {}
            times[label].append(bench.costed_batch(sender(task, base), n, cpu[label],
                                                  spent=spent))
            send_times[label].append(bench.last_send_seconds)
            round_cpu[label].append({r: v / n * 1e6 for r, v in spent.items()})
            keys_left[label] += bench.lock_keys() - keys_before
            offset += n
            # what the batch cost, from the servers themselves (the INFO calls
            # themselves are left out)
            for acc, d in ((lock_cmds[label], delta(lock_before,
                                                    commandstats(bench.lock_client))),
                           (broker_cmds[label], delta(broker_before,
                                                      commandstats(bench.broker.client())))):
                for cmd, calls in d.items():
                    if cmd != "info":
                        acc[cmd] = acc.get(cmd, 0) + calls
    # Round trips: one monitored batch per configuration, outside the timing.
    trips: dict[str, Counter[str]] = {}
    monitored_n = min(n, 300)
    for label, name, _dist in configs:
        task = bench.app.tasks[name]
        base = offset
        sent, _inner = bench.monitored(
            functools.partial(bench.batch, sender(task, base), monitored_n))
        offset += monitored_n
        trips[label] = sent
    total = n * bench.sizes.rounds
    rows = []
    for label, _name, dist in configs:
        med = statistics.median(times[label])
        # paired: each round's batch against plain Celery's batch of the same
        # round, so a machine slower in one round than another cancels out
        ratios = [x / p for x, p in zip(times[label], times["plain Celery"])]
        per_task = {k: v / total for k, v in sorted(lock_cmds[label].items())
                    if k.split("|")[0] not in SETUP_COMMANDS}
        rows.append({
            "config": label,
            "version": version(dist),
            "tasks_per_s": n / med,
            "time_ratio": statistics.median(ratios),
            "time_ratios": ratios,
            "batch_seconds": times[label],
            "lock_commands_per_task": per_task,
            "lock_calls_per_task": sum(
                v for k, v in per_task.items() if k not in SETUP_COMMANDS),
            "round_trips_per_task": {k: v / monitored_n
                                     for k, v in sorted(trips[label].items())},
            "round_trips_total_per_task": sum(trips[label].values()) / monitored_n,
            # CPU every process of the run spent per task (the machine's cores
            # are shared by all of them, so this is what the time is made of)
            "cpu_us_per_task": {role: cpu[label][role] / total * 1e6 for role in CPU_ROLES},
            # each round's batch alone, for ratios paired by round
            "cpu_us_per_task_rounds": round_cpu[label],
            # the sending loop alone: what the sender waits for (the peers
            # take their lock in apply_async)
            "send_seconds": send_times[label],
            # what the lock Redis still holds once the batch is through
            "lock_redis_keys_left_per_task": keys_left[label] / total,
            "broker_calls_per_task": sum(
                v for k, v in broker_cmds[label].items()
                if k != "incr" and k not in SETUP_COMMANDS
            ) / total,
        })
    bench.results["throughput"] = {"tasks_per_batch": n, "rounds": bench.sizes.rounds,
                                  "rows": rows}
