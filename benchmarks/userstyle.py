"""The side-by-side run a user comparing libraries would write: no-op tasks
that count themselves with one ``INCR``, prefork ``-c 2``, results ignored,
the sender in the same script, drain time from the first send to the last
task done. Plain Celery, ours, the peers and the floor of a lock taken in the
worker (a bare SET NX before the body, DEL after) take turns within each round.
Beside each drain, the CPU every process used during it (``/proc``), per task:
the sending script, the worker (its main process and pool processes) and the
Redis servers (broker, counter and locks).

Conditions: broker and locks on one Redis, or locks on a Redis of their own;
``worker_prefetch_multiplier`` 4 and 8. ::

    python -m benchmarks.userstyle                 # 3000 tasks, 4 rounds
    python -m benchmarks.userstyle --tasks 300 --rounds 1
    python -m benchmarks.userstyle --bounds        # and two bounds of a scripted lock
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from .harness import (
    FLOOR,
    child_pids,
    command_us,
    cpu_model,
    cpu_seconds,
    sched_us,
    thread_us,
    version,
)
from .servers import ROOT, Redis
from .servers import Worker as _BenchWorker

#: whose CPU is read around each drain: the worker's main process (it takes
#: the messages from the broker and hands them to the pool) apart from its
#: pool processes (where the tasks, and ours' lock calls, run)
ROLES = ("sender", "worker main", "pool", "Redis")

#: read around each drain too, per task: where the drain's time goes when the
#: worker's main process is the bottleneck (it waits for a CPU, or for the pool).
#: "idle": the drain less the run time and the wait for a CPU of the main
#: process's main thread (schedstat): neither running nor runnable, waiting on
#: a Redis reply or with nothing to hand out
TIMINGS = ("Redis commands", "worker main waiting for a CPU", "worker main idle")

CONFIGS = (("plain Celery", "user.plain", "celery"),
           ("celery-singleton-lock", "user.ours", "celery-singleton-lock"),
           ("celery-singleton", "user.celery_singleton", "celery-singleton"),
           ("celery-once", "user.celery_once", "celery-once"),
           (FLOOR, "user.floor", "redis"))
#: with ``--bounds``: locks whose steps are Redis scripts, taken in the worker
#: as the floor is (benchmarks/userapp.py): what any design of ours' kind could
#: reach, the barest fenced pair of scripts and a grant script whose owner record
#: a plain ``HDEL`` frees
FENCED = "bound: fenced pair of scripts"
HASHFIELD = "bound: grant script + HDEL"
BOUNDS = ((FENCED, "user.fenced", "redis"), (HASHFIELD, "user.hashfield", "redis"))
#: the libraries users pick today, against which ours is set (the floor is a bound)
PEERS = ("celery-singleton", "celery-once")
TOPOLOGIES = ("one Redis", "own lock Redis")
PREFETCH = (4, 8)


class Worker(_BenchWorker):
    """`celery -A benchmarks.userapp worker -c 2`."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env, 2, queue=env["USER_QUEUE"])
        self.cmd[self.cmd.index("benchmarks.benchapp:app")] = "benchmarks.userapp:app"


def caller(env: dict[str, str]) -> Any:
    """The worker's own app and task classes, so the peers lock in the sender;
    imported once per process (each condition runs in a process of its own)."""
    os.environ.update(env)
    from . import userapp

    return userapp.app


def drain(app: Any, counter: Any, name: str, base: int, n: int) -> float:
    """Send ``n`` tasks, wait for the last to count itself; seconds from the first send."""
    counter.set("done", 0)
    task = app.tasks[name]
    started = time.perf_counter()
    for i in range(n):
        task.delay(base + i)
    deadline = time.monotonic() + 600
    while int(counter.get("done") or 0) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: only {counter.get('done')} of {n} done")
        time.sleep(0.002)
    return time.perf_counter() - started


def condition(broker_url: str, lock_url: str, counter_url: str, prefetch: int, tasks: int,
              rounds: int, redis_pids: list[int], bounds: bool = False) -> dict[str, Any]:
    """One condition, in this process: its worker, a warm-up, then every
    configuration in a shuffled order each round: drain seconds and CPU µs
    per task by role, per configuration and round."""
    import redis

    queue = f"user-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, USER_BROKER_URL=broker_url, USER_LOCK_URL=lock_url,
               USER_COUNTER_URL=counter_url, USER_PREFETCH=str(prefetch), USER_QUEUE=queue,
               USER_BOUNDS="1" if bounds else "")
    worker = Worker(env)
    try:
        worker.start()  # the warm-up batch waits for it
        app = caller(env)
        counter = redis.Redis.from_url(counter_url)
        servers = [redis.Redis.from_url(u) for u in dict.fromkeys((broker_url, lock_url))]
        configs = [c for c in CONFIGS + (BOUNDS if bounds else ()) if c[1] in app.tasks]
        # warm-up: the worker boots, each library connects and loads its scripts
        for i, (_, name, _) in enumerate(configs):
            drain(app, counter, name, -10 * tasks * (i + 1), max(10, tasks // 10))
        times: dict[str, list[float]] = {c[0]: [] for c in configs}
        cpu: dict[str, list[dict[str, float]]] = {c[0]: [] for c in configs}
        timings: dict[str, list[dict[str, float]]] = {c[0]: [] for c in configs}
        offset = 0
        for _ in range(rounds):
            order = list(configs)
            random.shuffle(order)
            for label, name, _ in order:
                pids = {"sender": [os.getpid()], "worker main": [worker.pid],
                        "pool": child_pids(worker.pid), "Redis": redis_pids}
                before = {role: cpu_seconds(pids[role]) for role in ROLES}
                commands, (_, waited) = command_us(servers), sched_us(pids["worker main"])
                busy = sum(thread_us(worker.pid))
                times[label].append(drain(app, counter, name, offset, tasks))
                cpu[label].append({role: (cpu_seconds(pids[role]) - before[role]) / tasks * 1e6
                                   for role in ROLES})
                busy = sum(thread_us(worker.pid)) - busy
                timings[label].append(dict(zip(TIMINGS, (
                    (command_us(servers) - commands) / tasks,
                    (sched_us(pids["worker main"])[1] - waited) / tasks,
                    (times[label][-1] * 1e6 - busy) / tasks))))
                offset += tasks
        return {"times": times, "cpu": cpu, "timings": timings}
    finally:
        # a warm shutdown: the peers free a lock after the task's body has
        # counted itself, and the next condition sends the same arguments
        worker.stop()


def run(tasks: int, rounds: int, bounds: bool = False) -> dict[str, Any]:
    broker, own = Redis().start(), Redis().start()
    results: dict[str, Any] = {"tasks": tasks, "rounds": rounds, "conditions": []}
    try:
        for topology in TOPOLOGIES:
            for prefetch in PREFETCH:
                lock = broker.url(0) if topology == "one Redis" else own.url(0)
                servers = [broker] if topology == "one Redis" else [broker, own]
                redis_pids = [s.proc.pid for s in servers if s.proc is not None]
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.userstyle", "--condition",
                     json.dumps([broker.url(0), lock, broker.url(3), prefetch, tasks, rounds,
                                 redis_pids, bounds])],
                    cwd=ROOT, capture_output=True, text=True, check=True)
                measured = json.loads(out.stdout.strip().splitlines()[-1])
                times, cpu, timings = measured["times"], measured["cpu"], measured["timings"]
                rows = []
                for label, _, dist in CONFIGS + BOUNDS:
                    if label not in times:
                        continue
                    ratios = [t / p for t, p in zip(times[label], times["plain Celery"])]
                    by_role = {role: statistics.median(c[role] for c in cpu[label])
                               for role in ROLES}
                    rows.append({"config": label, "version": version(dist),
                                 "median_seconds": statistics.median(times[label]),
                                 "seconds": times[label],
                                 "ratio_to_plain": statistics.median(ratios),
                                 "cpu_us_per_task": statistics.median(
                                     sum(c.values()) for c in cpu[label]),
                                 "cpu_us_per_task_by_role": by_role,
                                 "cpu_rounds": cpu[label],
                                 "timings_us_per_task": {
                                     t: statistics.median(r[t] for r in timings[label])
                                     for t in TIMINGS},
                                 "timing_rounds": timings[label]})
                results["conditions"].append({
                    "topology": topology, "prefetch": prefetch, "rows": rows,
                    "ours_by_round": by_round(times),
                    "floor_by_round": by_round(times, FLOOR),
                    "bounds_by_round": {label: by_round(times, label)
                                        for label, _, _ in BOUNDS if label in times}})
    finally:
        broker.stop()
        own.stop()
    return results


def by_round(times: dict[str, list[float]], mine: str = "celery-singleton-lock"
             ) -> Optional[dict[str, Any]]:
    """Ours (or ``mine``: the floor) against the faster peer of each round: the
    rounds' ratios (its drain over that peer's), their median, and in how many
    rounds it was at or below both peers. Each round's libraries ran back to
    back, so a ratio by round leaves out what the machine did between rounds."""
    ours = times.get(mine)
    peers = [times[label] for label in PEERS if label in times]
    if not ours or not peers:
        return None
    ratios = [o / min(p) for o, *p in zip(ours, *peers)]
    return {"ratios": ratios, "median": statistics.median(ratios),
            "won": sum(1 for r in ratios if r <= 1.0), "rounds": len(ratios)}


def render(results: dict[str, Any]) -> str:
    out = [f"{results['tasks']} no-op tasks a batch, {results['rounds']} rounds, prefork -c 2; "
           "drain seconds, median (min-max), the median ratio to plain Celery by round, "
           f"CPU µs per task (medians): all processes ({' / '.join(ROLES)}), and µs per "
           f"task (medians): {' / '.join(TIMINGS)}"]
    for cond in results["conditions"]:
        out.append(f"\n{cond['topology']}, prefetch {cond['prefetch']}:")
        for row in sorted(cond["rows"], key=lambda r: r["median_seconds"]):
            out.append(f"  {row['config']:<24} {row['median_seconds']:.3f} s "
                       f"({min(row['seconds']):.3f}-{max(row['seconds']):.3f})  "
                       f"x{row['ratio_to_plain']:.3f}  CPU {cpu_cell(row)}  "
                       f"{timing_cell(row)}")
        mines = [("ours", cond.get("ours_by_round")), ("the floor", cond.get("floor_by_round")),
                 *cond.get("bounds_by_round", {}).items()]
        for who, mine in mines:
            if mine:
                out.append(f"  {who} / the faster peer, by round: median {mine['median']:.3f}, "
                           f"at or below both in {mine['won']} of {mine['rounds']} rounds")
    return "\n".join(out)


def cpu_cell(row: dict[str, Any]) -> str:
    """A row's CPU µs per task: all processes, then each role's in brackets
    (medians of the rounds); "-" for a run from before CPU was read."""
    roles = row.get("cpu_us_per_task_by_role")
    if not roles:
        return "-"
    return (f"{row['cpu_us_per_task']:.0f} ("
            + " / ".join(f"{roles[role]:.0f}" for role in ROLES if role in roles) + ")")


def timing_cell(row: dict[str, Any]) -> str:
    """A row's :data:`TIMINGS`, µs per task (medians of the rounds); "-" for a
    run from before they were read (and for one of them, from before it was)."""
    timings = row.get("timings_us_per_task")
    if not timings:
        return "-"
    return " / ".join(f"{timings[t]:.1f}" if t in timings else "-" for t in TIMINGS)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.userstyle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--bounds", action="store_true",
                        help="also drain two bounds of a lock whose steps are scripts")
    parser.add_argument("--condition", help=argparse.SUPPRESS)  # one condition, as a child
    args = parser.parse_args(argv)
    if args.condition:
        print(json.dumps(condition(*json.loads(args.condition))))
        return 0
    results = run(args.tasks, args.rounds, args.bounds)
    results["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "load": os.getloadavg(), "python": sys.version.split()[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "userstyle.json").write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
