"""Measure celery-singleton-lock beside plain Celery and the libraries users pick today.

    python -m benchmarks.run              # the full run (about 8 minutes on 2 cores)
    python -m benchmarks.run --quick      # tiny sizes: proves it still runs
    python -m benchmarks.run --profile    # where our time goes, with pyinstrument
    python -m benchmarks.run --only real,capacity   # some sections, merged into results.json

Everything runs in one invocation against redis-servers the run starts itself:
one for the broker and one for the locks, so the lock libraries' Redis commands
can be counted from Redis itself (``INFO commandstats``). Configurations
alternate within each round and medians are reported, so a noisy machine hits
them all alike. Writes ``results.json``, ``results.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import random
import statistics
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from . import capacity
from .servers import ROOT, Redis, Worker


@dataclass(frozen=True)
class Sizes:
    tasks: int          # tasks per throughput batch
    rounds: int         # rounds of every configuration
    heartbeat: tuple[int, ...]
    storm: int          # duplicate deliveries
    storm_keys: int
    latency: int        # acquire/release pairs per lock
    real_io: int        # 5 ms I/O tasks per batch
    real_cpu: int       # 20 ms CPU tasks per batch
    real_rounds: int
    capacity_processes: int
    capacity_seconds: float
    capacity_rounds: int
    concurrency: int = 2


FULL = Sizes(tasks=1000, rounds=9, heartbeat=(1, 100, 1000, 10000), storm=4000, storm_keys=4,
             latency=5000, real_io=300, real_cpu=80, real_rounds=9, capacity_processes=6,
             capacity_seconds=3.0, capacity_rounds=3)
QUICK = Sizes(tasks=40, rounds=1, heartbeat=(1, 100), storm=60, storm_keys=2, latency=200,
              real_io=10, real_cpu=4, real_rounds=1, capacity_processes=2,
              capacity_seconds=0.25, capacity_rounds=1)

SECTIONS = ("throughput", "storm", "heartbeat", "latency", "real", "capacity")

# connection set-up, not part of a task's cost
SETUP_COMMANDS = {"hello", "client", "ping", "script", "info", "select", "echo", "auth"}

FLOOR = "floor: bare SET NX + DEL"
CONFIGS = [
    ("plain Celery", "bench.plain", "celery"),
    ("celery-singleton-lock", "bench.ours", "celery-singleton-lock"),
    ("celery-singleton", "bench.celery_singleton", "celery-singleton"),
    ("celery-once", "bench.celery_once", "celery-once"),
    # no library: SET NX + DEL in the task body, the least a worker-side lock costs
    (FLOOR, "bench.floor", "redis"),
]
PEERS = ("celery-singleton", "celery-once")

# tasks that do work: (label, seconds of I/O, milliseconds of CPU)
REAL_KINDS = (("5 ms I/O", 0.005, 0.0), ("20 ms CPU", 0.0, 20.0))
REAL_POOLS = ("prefork", "threads")
REAL_CONFIGS = (("plain Celery", "bench.real_plain"),
                ("celery-singleton-lock", "bench.real_ours"),
                (FLOOR, "bench.real_floor"))


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def commandstats(client: Any) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in client.info("commandstats").items()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def redis_keys(client: Any) -> int:
    """Keys in every db of the server: what a batch left behind."""
    keyspace = client.info("keyspace")
    return sum(int(db.get("keys", 0)) for db in keyspace.values() if isinstance(db, dict))


def key_bytes(client: Any, keys: list[str]) -> float:
    """Mean ``MEMORY USAGE`` of the keys that exist (0 when none does)."""
    sizes = [client.memory_usage(k, samples=0) for k in keys]
    found = [x for x in sizes if x is not None]
    return sum(found) / len(found) if found else 0.0


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time the processes used so far (Linux /proc; 0 elsewhere)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


CPU_ROLES = ("worker main process", "worker pool processes", "lock Redis", "broker Redis",
             "sending client")


def sender(task: Any, base: int) -> Callable[[int], Any]:
    """Sends task number ``i`` of a batch, with arguments no other batch uses."""
    return lambda i: task.delay(base + i)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Bench:
    def __init__(self, sizes: Sizes, out: Path, sections: tuple[str, ...] = SECTIONS) -> None:
        self.sizes = sizes
        self.out = out
        self.sections = sections
        self.broker = Redis().start()
        self.locks = Redis().start()
        queue = f"bench-{uuid.uuid4().hex[:6]}"
        os.environ.update({"BENCH_BROKER_URL": self.broker.url(0),
                           "BENCH_LOCK_URL": self.locks.url(0), "BENCH_QUEUE": queue})
        from . import benchapp  # after the environment names our servers

        self.app = benchapp.app
        self.counters = self.broker.client(3)
        self.lock_client = self.locks.client(0)
        self.worker = Worker(dict(os.environ), sizes.concurrency).start()
        # the same app in a thread pool, on a queue of its own; both boot at once
        self.threads: Optional[Worker] = None
        if "real" in sections:
            self.threads = Worker(dict(os.environ), sizes.concurrency, pool="threads",
                                  queue=f"{queue}-threads").start()
        # the capacity run's own Redis and client processes, which import meanwhile
        self.capacity_redis: Optional[Redis] = None
        self.clients: Optional[capacity.Clients] = None
        if "capacity" in sections:
            self.capacity_redis = Redis().start()
            self.clients = capacity.Clients(self.capacity_redis.url(0), sizes.capacity_processes)
        self.last_send_seconds = self.last_send_cpu = 0.0
        self.results: dict[str, Any] = {}

    def close(self) -> None:
        if self.clients is not None:
            self.clients.stop()
        if self.capacity_redis is not None:
            self.capacity_redis.stop()
        if self.threads is not None:
            self.threads.stop()
        self.worker.stop()
        self.broker.stop()
        self.locks.stop()

    # -- helpers -----------------------------------------------------------------

    def available(self) -> list[tuple[str, str, str]]:
        return [c for c in CONFIGS if c[1] in self.app.tasks]

    def lock_keys(self) -> int:
        """Keys in the lock Redis, the workers' published counters and held-lock
        lists left out (each pool process writes them once a second, and the
        held list vanishes whenever it empties)."""
        from celery_singleton_lock.config import get_config
        from celery_singleton_lock.monitor import held_key, stats_key

        prefix = get_config(self.app).key_prefix
        published = int(self.lock_client.exists(stats_key(prefix), held_key(prefix)))
        return redis_keys(self.lock_client) - published

    def processes(self, worker: Optional[Worker] = None) -> dict[str, list[int]]:
        """Every process a batch keeps busy, by role (the pool as it is now; a
        thread pool has no pool process, its threads are the main process's)."""
        worker = worker or self.worker
        main = worker.proc.pid if worker.proc is not None else 0
        return {
            "worker main process": [main],
            "worker pool processes": child_pids(main),
            "lock Redis": [self.locks.proc.pid] if self.locks.proc is not None else [],
            "broker Redis": [self.broker.proc.pid] if self.broker.proc is not None else [],
            "sending client": [os.getpid()],
        }

    def wait_processed(self, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while (done := int(self.counters.get("processed") or 0)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"the worker processed only {done} of {n} tasks; "
                                 f"see {self.worker.log}")
            time.sleep(0.002)

    def batch(self, send: Callable[[int], Any], n: int) -> float:
        self.counters.set("processed", 0)
        started = time.perf_counter()
        cpu = time.process_time()
        for i in range(n):
            send(i)
        # what sending alone took (the worker is already running the first ones),
        # and its CPU: the driver's waiting for the batch to finish is not the sender's
        self.last_send_cpu = time.process_time() - cpu
        self.last_send_seconds = time.perf_counter() - started
        self.wait_processed(n)
        return time.perf_counter() - started

    def costed_batch(self, send: Callable[[int], Any], n: int, cpu: dict[str, float],
                     worker: Optional[Worker] = None,
                     spent: Optional[dict[str, float]] = None) -> float:
        """:meth:`batch`, adding the CPU each process role spent to ``cpu`` (and
        this batch's alone to ``spent``)."""
        procs = self.processes(worker)
        del procs["sending client"]  # its sending loop's alone, measured by batch()
        before = {role: cpu_seconds(pids) for role, pids in procs.items()}
        took = self.batch(send, n)
        after = {role: cpu_seconds(pids) - before[role] for role, pids in procs.items()}
        for role in CPU_ROLES:
            used = after.get(role, self.last_send_cpu)
            cpu[role] = cpu.get(role, 0.0) + used
            if spent is not None:
                spent[role] = used
        return took

    def monitored(self, work: Callable[[], Any]) -> tuple[Counter[str], Counter[str]]:
        """Commands the lock Redis received while ``work`` ran, as MONITOR shows them:
        (sent by clients: one round trip each, run inside scripts)."""
        from celery_singleton_lock.config import get_config
        from celery_singleton_lock.monitor import held_key, stats_key

        sent: Counter[str] = Counter()
        inner: Counter[str] = Counter()
        ready = threading.Event()
        stop = f"bench-stop-{uuid.uuid4().hex}"
        # each pool process publishes its counters and held locks once a second
        # (not per task); left out here, it would land on whichever batch runs then
        prefix = get_config(self.app).key_prefix
        publishing = {stats_key(prefix), held_key(prefix)}

        def watch() -> None:
            with self.locks.client().monitor() as monitor:  # type: ignore[no-untyped-call]
                ready.set()
                for cmd in monitor.listen():
                    text = cmd["command"]
                    if stop in text:
                        return
                    name = text.split(" ", 1)[0].lower()
                    if publishing.intersection(text.split(" ", 2)[1:2]):
                        continue
                    if cmd.get("client_type") == "lua":
                        inner[name] += 1
                    elif name not in SETUP_COMMANDS:
                        sent[name] += 1

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        ready.wait(10)
        time.sleep(0.05)
        work()
        self.lock_client.echo(stop)
        thread.join(30)
        return sent, inner

    # -- 1 and 2: throughput and Redis cost per task --------------------------------

    def throughput(self) -> None:
        configs = self.available()
        plain = self.app.tasks["bench.plain"]
        self.batch(lambda i: plain.delay(-i), max(50, self.sizes.tasks // 4))  # warm up
        times: dict[str, list[float]] = {c[0]: [] for c in configs}
        cpu: dict[str, dict[str, float]] = {c[0]: dict.fromkeys(CPU_ROLES, 0.0) for c in configs}
        lock_cmds: dict[str, dict[str, int]] = {c[0]: {} for c in configs}
        keys_left: dict[str, int] = {c[0]: 0 for c in configs}
        send_times: dict[str, list[float]] = {c[0]: [] for c in configs}
        round_cpu: dict[str, list[dict[str, float]]] = {c[0]: [] for c in configs}
        broker_cmds: dict[str, dict[str, int]] = {c[0]: {} for c in configs}
        n = self.sizes.tasks
        offset = 0
        for _ in range(self.sizes.rounds):
            order = configs[:]
            random.shuffle(order)
            for label, name, _dist in order:
                task = self.app.tasks[name]
                lock_before = commandstats(self.lock_client)
                broker_before = commandstats(self.broker.client())
                base = offset
                keys_before = self.lock_keys()
                spent: dict[str, float] = {}
                times[label].append(self.costed_batch(sender(task, base), n, cpu[label],
                                                      spent=spent))
                send_times[label].append(self.last_send_seconds)
                round_cpu[label].append({r: v / n * 1e6 for r, v in spent.items()})
                keys_left[label] += self.lock_keys() - keys_before
                offset += n
                # what the batch cost, from the servers themselves (the INFO calls
                # themselves are left out)
                for acc, d in ((lock_cmds[label], delta(lock_before,
                                                        commandstats(self.lock_client))),
                               (broker_cmds[label], delta(broker_before,
                                                          commandstats(self.broker.client())))):
                    for cmd, calls in d.items():
                        if cmd != "info":
                            acc[cmd] = acc.get(cmd, 0) + calls
        # Round trips: one monitored batch per configuration, outside the timing.
        trips: dict[str, Counter[str]] = {}
        monitored_n = min(n, 300)
        for label, name, _dist in configs:
            task = self.app.tasks[name]
            base = offset
            sent, _inner = self.monitored(
                functools.partial(self.batch, sender(task, base), monitored_n))
            offset += monitored_n
            trips[label] = sent
        total = n * self.sizes.rounds
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
        self.results["throughput"] = {"tasks_per_batch": n, "rounds": self.sizes.rounds,
                                      "rows": rows}

    # -- 3: heartbeat scaling ---------------------------------------------------------

    def heartbeat(self) -> None:
        from celery_singleton_lock import SingletonConfig
        from celery_singleton_lock.engine import RENEW_CHUNK
        from celery_singleton_lock.engines import connect
        from celery_singleton_lock.heartbeat import Heartbeat
        from celery_singleton_lock.keys import LockKeys
        from celery_singleton_lock.lock import SingletonLock

        engine = connect(SingletonConfig.defaults(self.locks.url(5)))
        client = self.locks.client(5)
        rows = []
        for n in self.sizes.heartbeat:
            client.flushdb()
            locks = []
            for i in range(n):
                keys = LockKeys("bench:", f"{i:032x}")
                got = engine.acquire(keys, task_id=f"t{i}", exec_id=f"e{i}", lease_ms=60_000,
                                     hostname="bench", retries=0, task_name="bench")
                locks.append(SingletonLock(keys, task_id=f"t{i}", exec_id=f"e{i}",
                                           token=got.token, lease=60.0,
                                           started=time.monotonic(), held=True))
            sample = [lk.keys for lk in locks[:50]]
            held_bytes = (key_bytes(client, [k.lock for k in sample])
                          + key_bytes(client, [k.fence for k in sample]))
            entries = [(lk.keys.lock, lk.exec_id, 60_000) for lk in locks]
            engine.renew(entries)  # the first call also loads the script
            durations = []
            before = commandstats(self.lock_client)
            repeats = 5
            for _ in range(repeats):
                started = time.perf_counter()
                engine.renew(entries)
                durations.append(time.perf_counter() - started)
            calls = delta(before, commandstats(self.lock_client)).get("evalsha", 0)
            # what another client of this Redis sees while the locks renew: PING
            # latency, chunked renewals against one call for every lock
            stall = {}
            for label, chunk in (("chunked", engine.renew_chunk), ("one call", max(n, 1))):
                engine.renew_chunk = chunk
                stall[label] = ping_latency_while(
                    self.locks.port, functools.partial(engine.renew, entries), repeats)
            engine.renew_chunk = RENEW_CHUNK
            # the real renewer: rounds and commands over a few intervals of a 0.3 s lease
            hb = Heartbeat(engine)
            for lk in locks:
                lk.lease = 0.3
                hb.add(lk)
            # count whole rounds only: start right after one ends, stop once the
            # last one in flight has ended
            first = hb.rounds
            while hb.rounds == first:
                time.sleep(0.001)
            rounds_before = hb.rounds
            before = commandstats(self.lock_client)
            time.sleep(1.0)
            lost = sum(1 for lk in locks if lk.lost)  # while still renewed
            for lk in locks:
                hb.discard(lk)
            time.sleep(0.4)
            hb_calls = delta(before, commandstats(self.lock_client)).get("evalsha", 0)
            hb_rounds = hb.rounds - rounds_before
            for lk in locks:
                engine.release(lk.keys, lk.exec_id, lk.task_id)
            left_bytes = sum(key_bytes(client, [getattr(k, part) for k in sample])
                             for part in ("lock", "fence", "fin", "queued", "done"))
            rows.append({
                "locks": n,
                "renew_ms_median": statistics.median(durations) * 1000,
                "renew_ms_max": max(durations) * 1000,
                "commands_per_renewal": calls / repeats,
                "ping_ms_while_renewing": stall,
                "heartbeat_rounds": hb_rounds,
                "commands_per_interval": hb_calls / max(hb_rounds, 1),
                "lost": lost,
                # MEMORY USAGE of the keys one lock uses while held, and after
                # its release (the fencing counter outlives the lock)
                "redis_bytes_per_held_lock": held_bytes,
                "redis_bytes_left_per_released_lock": left_bytes,
            })
        client.flushdb()
        self.results["heartbeat"] = rows

    # -- 4: duplicate storm --------------------------------------------------------------

    def storm(self) -> None:
        from celery_singleton_lock.engines import engine_for

        storm = self.app.tasks["bench.storm"]
        plain = self.app.tasks["bench.plain"]
        n, k = self.sizes.storm, self.sizes.storm_keys
        keys = [f"account-{i}" for i in range(k)]
        # (a) the skip path alone: every key held by a long execution elsewhere
        engine = engine_for(self.app)
        held = []
        for key in keys:
            lk = storm.singleton_keys(key, 0.0)
            engine.acquire(lk, task_id=f"holder-{key}", exec_id=uuid.uuid4().hex,
                           lease_ms=600_000, hostname="elsewhere", retries=0,
                           task_name=storm.name)
            held.append(lk)
        one_trip = self.app.tasks["bench.one_trip"]
        skip_times, plain_times, trip_times = [], [], []
        kinds = ("skipped duplicate", "plain task", "plain task + one GET")
        cpu: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
        rounds = max(1, min(3, self.sizes.rounds - 2))
        for _ in range(rounds):
            self.counters.set("executions", 0)
            skip_times.append(self.costed_batch(lambda i: storm.delay(keys[i % k], 0.0), n,
                                                cpu[kinds[0]]))
            assert int(self.counters.get("executions") or 0) == 0
            plain_times.append(self.costed_batch(lambda i: plain.delay(i), n, cpu[kinds[1]]))
            trip_times.append(self.costed_batch(lambda i: one_trip.delay(i), n, cpu[kinds[2]]))
        for lk in held:
            self.lock_client.delete(lk.lock)
        # (b) real executions racing: bursts of duplicates of one key, each run
        # 5 ms, so the worker's processes keep meeting each other on a key
        self.counters.set("overlaps", 0)
        self.counters.set("executions", 0)
        mixed = self.batch(lambda i: storm.delay(keys[(i // 25) % k], 0.005), n)
        executions = int(self.counters.get("executions") or 0)
        self.results["storm"] = {
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
            "overlapping_executions": int(self.counters.get("overlaps") or 0),
        }

    # -- 5: acquire/release latency ------------------------------------------------------

    def latency(self) -> None:
        from celery_singleton_lock import SingletonConfig
        from celery_singleton_lock.engines import connect
        from celery_singleton_lock.keys import LockKeys

        engine = connect(SingletonConfig.defaults(self.locks.url(6)))
        client = self.locks.client(6)
        ours_keys = LockKeys("bench:", "f" * 32)
        samples: dict[str, dict[str, list[float]]] = {
            "celery-singleton-lock": {"acquire": [], "release": []},
            "redis-py Lock": {"acquire": [], "release": []},
        }
        clock = time.perf_counter

        def ours(i: int) -> tuple[float, float]:
            t0 = clock()
            got = engine.acquire(ours_keys, task_id=f"t{i}", exec_id=f"e{i}", lease_ms=30_000,
                                 hostname="bench", retries=0, task_name="bench")
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
        for start in range(0, self.sizes.latency, block):
            for name, fn in (("celery-singleton-lock", ours), ("redis-py Lock", redis_py)):
                for i in range(start, min(start + block, self.sizes.latency)):
                    a, r = fn(i)
                    samples[name]["acquire"].append(a)
                    samples[name]["release"].append(r)
        client.flushdb()
        self.results["latency"] = {
            name: {op: {"p50_us": percentile(v, 0.5) * 1e6, "p99_us": percentile(v, 0.99) * 1e6}
                   for op, v in ops.items()}
            for name, ops in samples.items()
        }

    # -- 6: tasks that do work, prefork and threads ----------------------------------------

    def real(self) -> None:
        assert self.threads is not None
        pools = {"prefork": (self.worker, self.app.conf.task_default_queue),
                 "threads": (self.threads, self.threads.queue)}
        plain = self.app.tasks["bench.real_plain"]
        for _worker, queue in pools.values():  # warm up; the thread pool has booted by then
            def warm(i: int, queue: str = queue) -> Any:
                return plain.apply_async((-1 - i, 0.0, 0), queue=queue)

            self.batch(warm, max(20, self.sizes.real_io))
        cases = [(kind, pool, label) for kind, _, _ in REAL_KINDS for pool in REAL_POOLS
                 for label, _ in REAL_CONFIGS]
        times: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
        cpu: dict[tuple[str, str, str], dict[str, float]] = {c: {} for c in cases}
        traced: dict[tuple[str, str, str], list[int]] = {c: [] for c in cases}
        names = dict(REAL_CONFIGS)
        for name in names.values():
            self.counters.delete(f"traced:{name}")
        work = {kind: (io, ms / 1000) for kind, io, ms in REAL_KINDS}
        offset = 0
        for _ in range(self.sizes.real_rounds):
            order = cases[:]
            random.shuffle(order)
            for case in order:
                kind, pool, label = case
                n = self.sizes.real_io if work[kind][0] else self.sizes.real_cpu
                task = self.app.tasks[names[label]]
                worker, queue = pools[pool]
                io, cpu_s = work[kind]

                def send(i: int, task: Any = task, base: int = offset, io: float = io,
                         cpu_s: float = cpu_s, queue: str = queue) -> Any:
                    return task.apply_async((base + i, io, cpu_s), queue=queue)

                times[case].append(self.costed_batch(send, n, cpu[case], worker=worker))
                offset += n
                key = f"traced:{names[label]}"
                traced[case] += [int(x) for x in self.counters.lrange(key, 0, -1)]
                self.counters.delete(key)
        rows = []
        for kind, _, _ in REAL_KINDS:
            n = self.sizes.real_io if work[kind][0] else self.sizes.real_cpu
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
                            / (n * self.sizes.real_rounds) * 1e6 for role in CPU_ROLES},
                    })
        self.results["real"] = {"rounds": self.sizes.real_rounds,
                                "worker_concurrency": self.sizes.concurrency, "rows": rows}

    # -- 7: capacity of one Redis ------------------------------------------------------

    def capacity(self) -> None:
        assert self.clients is not None and self.capacity_redis is not None
        assert self.capacity_redis.proc is not None
        self.results["capacity"] = self.clients.measure(
            self.capacity_redis.proc.pid, self.sizes.capacity_seconds, self.sizes.capacity_rounds)

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        load_at_start = list(os.getloadavg())
        took: dict[str, float] = {}
        for section in SECTIONS:
            if section in self.sections:
                began = time.monotonic()
                getattr(self, section)()
                took[section] = round(time.monotonic() - began, 1)
        self.results["machine"] = {
            "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "cpu_model": cpu_model(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "load_average_at_start": load_at_start,
            "sections": list(self.sections),
            "section_seconds": took,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "redis_server": self.lock_client.info("server")["redis_version"],
            "celery": version("celery"),
            "redis_py": version("redis"),
            "load_average_at_end": list(os.getloadavg()),
            "worker_processes": self.sizes.concurrency,
            "seconds": round(time.monotonic() - started, 1),
        }
        return self.results


# -- reporting ------------------------------------------------------------------------------

def _ratio_range(row: dict[str, Any]) -> str:
    ratios = row.get("time_ratios") or [row["time_ratio"]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def markdown(results: dict[str, Any]) -> str:
    lines = []
    if "throughput" in results:
        t = results["throughput"]
        lines += [
            f"### Throughput ({t['tasks_per_batch']} trivial tasks per batch, "
            f"{t['rounds']} rounds, medians)", "",
            "| configuration | version | tasks/s | rounds' range | time vs plain Celery (median of "
            "rounds, range) | lock round "
            "trips per task (MONITOR) | lock commands per task, scripts' inner ones included "
            "(commandstats) | broker commands per task |",
            "|---|---|---:|---:|---:|---|---|---:|",
        ]
        for row in t["rows"]:
            cmds = ", ".join(f"{k.upper()} {v:.2g}"
                             for k, v in row["lock_commands_per_task"].items() if v >= 0.01) or "-"
            trips = ", ".join(f"{k.upper()} {v:.2g}"
                              for k, v in row["round_trips_per_task"].items() if v >= 0.01)
            trips = (f"**{row['round_trips_total_per_task']:.2g}**"
                     + (f" ({trips})" if trips else ""))
            per_round = [t["tasks_per_batch"] / x for x in row["batch_seconds"]]
            lines.append(f"| {row['config']} | {row['version']} | {row['tasks_per_s']:.0f} | "
                         f"{min(per_round):.0f}-{max(per_round):.0f} | "
                         f"{row['time_ratio']:.3f}x ({_ratio_range(row)}) | {trips} | {cmds} "
                         f"| {row['broker_calls_per_task']:.1f} |")
        floor = next((r for r in t["rows"] if r["config"] == FLOOR), None)
        if floor is not None and floor.get("time_ratios"):
            against = []
            for row in t["rows"]:
                if row is floor or row["config"] == "plain Celery" or not row.get("time_ratios"):
                    continue
                paired = [x / f for x, f in zip(row["time_ratios"], floor["time_ratios"])]
                against.append(f"{row['config']} {statistics.median(paired):.3f}x")
            lines += ["", "Time against the floor, paired by round (median): "
                      + ", ".join(against) + "."]
        if all("cpu_us_per_task" in row for row in t["rows"]):
            plain_cpu = sum(t["rows"][0]["cpu_us_per_task"].values())
            lines += [
                "", "### CPU per task, by process (µs, all rounds)", "",
                "| configuration | " + " | ".join(CPU_ROLES) + " | all | vs plain Celery |",
                "|---|" + "---:|" * (len(CPU_ROLES) + 2),
            ]
            for row in t["rows"]:
                per = row["cpu_us_per_task"]
                every = sum(per.values())
                lines.append(f"| {row['config']} | "
                             + " | ".join(f"{per[r]:.0f}" for r in CPU_ROLES)
                             + f" | {every:.0f} | {every - plain_cpu:+.0f} |")
        if all("lock_redis_keys_left_per_task" in row for row in t["rows"]):
            lines += [
                "", "Keys the lock Redis still holds once a batch is through, per task: "
                + ", ".join(f"{row['config']} {row['lock_redis_keys_left_per_task']:.2f}"
                            for row in t["rows"]) + "."]
        lines += _md_peers(t)
    if "real" in results:
        lines += _md_real(results["real"])
    if "storm" in results:
        s = results["storm"]
        lines += [
            "", f"### Duplicate storm ({s['deliveries']} deliveries over {s['keys']} keys)", "",
            "| measure | value |", "|---|---:|",
            f"| skipped duplicates processed per second | {s['skip_tasks_per_s']:.0f} |",
            f"| plain Celery tasks per second, same run | {s['plain_tasks_per_s']:.0f} |",
            f"| plain tasks asking Redis one bare GET, per second (a skip's floor) | "
            f"{s['one_trip_tasks_per_s']:.0f} |",
            f"| skips against plain tasks / against the skip's floor | "
            f"{s['skip_tasks_per_s'] / s['plain_tasks_per_s']:.2f}x / "
            f"{s['skip_tasks_per_s'] / s['one_trip_tasks_per_s']:.2f}x |",
            f"| racing executions (5 ms each) that ran | {s['racing_executions']} |",
            f"| racing deliveries skipped | {s['racing_skipped']} |",
            f"| **overlapping executions of one key** | **{s['overlapping_executions']}** |",
        ]
        if "cpu_us_per_delivery" in s:
            lines += [
                "", "CPU per delivery in the storm, by process (µs):", "",
                "| delivery | " + " | ".join(CPU_ROLES) + " | all |",
                "|---|" + "---:|" * (len(CPU_ROLES) + 1),
            ]
            for kind, per in s["cpu_us_per_delivery"].items():
                lines.append(f"| {kind} | "
                             + " | ".join(f"{per.get(r, 0.0):.0f}" for r in CPU_ROLES)
                             + f" | {sum(per.values()):.0f} |")
    if "heartbeat" in results:
        lines += [
            "", "### Heartbeat: one worker process holding N locks", "",
            "| locks held | one renewal (median ms) | worst of 5 (ms) | script calls per renewal "
            "(one round trip) | calls per heartbeat interval | locks lost "
            "| PING p99 / max while renewing (ms) | same, one call for all locks "
            "| Redis bytes per held lock | bytes left per released lock (24 h) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["heartbeat"]:
            lines.append(f"| {row['locks']:,} | {row['renew_ms_median']:.2f} | "
                         f"{row['renew_ms_max']:.2f} | {row['commands_per_renewal']:g} | "
                         f"{row['commands_per_interval']:g} | {row['lost']} | "
                         f"{_ping(row, 'chunked')} | {_ping(row, 'one call')} | "
                         f"{row.get('redis_bytes_per_held_lock', 0):.0f} | "
                         f"{row.get('redis_bytes_left_per_released_lock', 0):.0f} |")
    if "latency" in results:
        lines += ["", "### Lock latency on loopback (µs)", "",
                  "| lock | acquire p50 | acquire p99 | release p50 | release p99 |",
                  "|---|---:|---:|---:|---:|"]
        for name, ops in results["latency"].items():
            lines.append(f"| {name} | {ops['acquire']['p50_us']:.0f} | "
                         f"{ops['acquire']['p99_us']:.0f} | {ops['release']['p50_us']:.0f} | "
                         f"{ops['release']['p99_us']:.0f} |")
    if "capacity" in results:
        lines += _md_capacity(results["capacity"])
    lines += ["", _md_machine(results["machine"])]
    for m in results.get("partial_runs", []):
        lines.append(f"Rerun of {', '.join(m.get('sections', []))}: " + _md_machine(m))
    lines.append("")
    return "\n".join(lines).lstrip("\n")


def _loads(m: dict[str, Any], key: str) -> str:
    return ", ".join(f"{x:.2f}" for x in m.get(key, [])) or "not recorded"


def _md_machine(m: dict[str, Any]) -> str:
    when = f", ending {m['date_utc']} UTC" if "date_utc" in m else ""
    model = f" ({m['cpu_model']})" if "cpu_model" in m else ""
    return (f"Machine: {m['cpus']} CPUs{model}, worker with {m.get('worker_processes', 2)} "
            f"processes, {m['platform']}, Python {m['python']}, "
            f"Redis {m['redis_server']}, Celery {m['celery']}, redis-py {m['redis_py']}; "
            f"load average (1, 5, 15 min) at the start {_loads(m, 'load_average_at_start')}, "
            f"at the end {_loads(m, 'load_average_at_end')}; the run took {m['seconds']} s"
            f"{when}.")


def _range(values: list[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def _md_peers(t: dict[str, Any]) -> list[str]:
    """Ours against each peer, sender and worker together, paired by round."""
    rows = {r["config"]: r for r in t["rows"]}
    ours = rows.get("celery-singleton-lock")
    if ours is None or "send_seconds" not in ours:
        return []
    n = t["tasks_per_batch"]
    lines = [
        "", "### End to end against each peer (sender and worker together)", "",
        "Each batch's time runs from the first `apply_async` to the last task finished, "
        "so it holds the sender's work (the peers take their lock there) and the worker's. "
        "Ratios are ours over the peer's, paired by round; CPU is every process of the run "
        "(worker main and pool, lock Redis, broker Redis, sender).", "",
        "| against | time, ours / theirs (median, rounds' range) | sending µs per task, ours "
        "/ theirs (median) | sender CPU µs per task, ours / theirs | all-process CPU µs per "
        "task, ours / theirs | ours - theirs per round (median, range) | ours at or below: "
        "time / CPU |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label in (*PEERS, FLOOR, "plain Celery"):
        peer = rows.get(label)
        if peer is None or "send_seconds" not in peer:
            continue
        ratios = [a / b for a, b in zip(ours["batch_seconds"], peer["batch_seconds"])]
        diffs = [sum(a.values()) - sum(b.values()) for a, b in
                 zip(ours["cpu_us_per_task_rounds"], peer["cpu_us_per_task_rounds"])]
        mine, theirs = sum(ours["cpu_us_per_task"].values()), sum(peer["cpu_us_per_task"].values())
        sending = (statistics.median(ours["send_seconds"]) / n * 1e6,
                   statistics.median(peer["send_seconds"]) / n * 1e6)
        snd = (ours["cpu_us_per_task"]["sending client"], peer["cpu_us_per_task"]["sending client"])
        verdict = (f"{'yes' if statistics.median(ratios) <= 1.0 else 'no'} / "
                   f"{'yes' if mine <= theirs else 'no'}")
        lines.append(
            f"| {label} | {statistics.median(ratios):.3f}x ({_range(ratios, '.2f')}) | "
            f"{sending[0]:.0f} / {sending[1]:.0f} | {snd[0]:.0f} / {snd[1]:.0f} | "
            f"{mine:.0f} / {theirs:.0f} | {statistics.median(diffs):+.0f} "
            f"({min(diffs):+.0f} to {max(diffs):+.0f}) | {verdict} |")
    return lines


def _md_real(real: dict[str, Any]) -> list[str]:
    lines = [
        "", f"### Tasks that do work ({real['rounds']} rounds, worker with "
        f"{real['worker_concurrency']} processes or threads)", "",
        "Batch time runs from the first send to the last task finished (every process "
        "of the run on the same cores); the time in the pool runs from `task_prerun` to "
        "`task_postrun` of each task (the lock's acquire and release are inside), the "
        "median over every task of every round.", "",
        "| task | pool | configuration | tasks per batch | tasks/s | batch time vs plain "
        "Celery (paired by round: median, range) | batch time vs the floor (paired: median, "
        "range) | time in the pool per task, median (p90) µs | over plain Celery | "
        "CPU µs per task, all processes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {(r["task"], r["pool"], r["config"]): r for r in real["rows"]}
    verdicts = []
    for row in real["rows"]:
        cpu = sum(row["cpu_us_per_task"].values())
        pool = "-"
        over = "-"
        if "pool_us_median" in row:
            plain = row["pool_us_median"] - row["pool_us_over_plain"]
            pool = f"{row['pool_us_median']:,.0f} ({row['pool_us_p90']:,.0f})"
            over = f"{row['pool_us_over_plain']:+.0f} ({row['pool_us_over_plain'] / plain:+.1%})"
        lines.append(
            f"| {row['task']} | {row['pool']} | {row['config']} | {row['tasks_per_batch']} | "
            f"{row['tasks_per_s']:.0f} | {row['time_ratio']:.3f}x "
            f"({_range(row['time_ratios'])}) | {row['floor_ratio']:.3f}x "
            f"({_range(row['floor_ratios'])}) | {pool} | {over} | {cpu:.0f} |")
        if row["config"] == REAL_CONFIGS[1][0] and "pool_us_median" in row:
            verdicts.append(_real_verdict(row, rows[(row["task"], row["pool"], FLOOR)],
                                          rows[(row["task"], row["pool"], "plain Celery")]))
    if verdicts:
        lines += ["", "Ours against the target (at most 1.02x plain Celery, and no more than "
                  "the floor), by each measure:", "",
                  "| task | pool | time in the pool, ours / floor over plain | all-process CPU, "
                  "ours / floor over plain | batch time, ours vs plain / vs floor |",
                  "|---|---|---|---|---|", *verdicts]
    return lines


def _real_verdict(ours: dict[str, Any], floor: dict[str, Any], plain: dict[str, Any]) -> str:
    def mark(ok: bool) -> str:
        return "met" if ok else "**missed**"

    base = plain["pool_us_median"]
    pool_o, pool_f = ours["pool_us_over_plain"] / base, floor["pool_us_over_plain"] / base
    cpu_p = sum(plain["cpu_us_per_task"].values())
    cpu_o = sum(ours["cpu_us_per_task"].values()) / cpu_p - 1
    cpu_f = sum(floor["cpu_us_per_task"].values()) / cpu_p - 1
    return (f"| {ours['task']} | {ours['pool']} | {pool_o:+.1%} / {pool_f:+.1%}: "
            f"{mark(pool_o <= 0.02 and pool_o <= pool_f)} | {cpu_o:+.1%} / {cpu_f:+.1%}: "
            f"{mark(cpu_o <= 0.02 and cpu_o <= cpu_f)} | {ours['time_ratio']:.3f}x / "
            f"{ours['floor_ratio']:.3f}x: "
            f"{mark(ours['time_ratio'] <= 1.02 and ours['floor_ratio'] <= 1.0)} |")


def _md_capacity(cap: dict[str, Any]) -> list[str]:
    lines = [
        "", f"### Capacity of one Redis ({cap['client_processes']} client processes, "
        f"{cap['seconds_per_run']:g} s per lock per round, {cap['rounds']} rounds, medians)", "",
        "One lock operation is an acquire or a release, on a key no other call uses. "
        "Redis CPU from `/proc` (everything the server did, sockets included); command time "
        "from `INFO commandstats` (inside the commands the clients sent).", "",
        "| lock | acquire + release pairs/s | lock operations/s | rounds' range (ops/s) | "
        "lock Redis CPU busy | Redis CPU µs per operation | of which in commands (µs) | "
        "commands sent per pair | client CPU µs per operation | operations/s one busy "
        "Redis core would sustain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in cap["rows"]:
        ops = [2 * x for x in row["pairs_per_s_rounds"]]
        lines.append(
            f"| {row['lock']} | {row['pairs_per_s']:,.0f} | {row['ops_per_s']:,.0f} | "
            f"{_range(ops, ',.0f')} | {row['redis_utilisation']:.0%} | "
            f"{row['redis_cpu_us_per_op']:.1f} | {row['redis_command_us_per_op']:.1f} | "
            f"{row['redis_calls_per_pair']:.2g} | {row['client_cpu_us_per_op']:.0f} | "
            f"{row['ops_per_s_per_redis_core']:,.0f} |")
    return lines


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    colours = {"plain Celery": "#9e9e9e", "celery-singleton-lock": "#1b7837",
               "celery-singleton": "#c2a5cf", "celery-once": "#762a83",
               FLOOR: "#4393c3"}

    if "throughput" in results:
        rows = results["throughput"]["rows"]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
        names = [textwrap.fill(r["config"], 14) for r in rows]
        ax1.bar(names, [r["tasks_per_s"] for r in rows], color=[colours[r["config"]] for r in rows])
        for i, r in enumerate(rows):
            ax1.text(i, r["tasks_per_s"], f"{r['time_ratio']:.2f}x time", ha="center", va="bottom")
        ax1.set_ylabel("tasks per second (higher is better)")
        ax1.set_title("Throughput, trivial task, prefork worker")
        ax1.tick_params(axis="x", labelsize=8)
        commands = sorted({c for r in rows for c in r["round_trips_per_task"]})
        bottom = [0.0] * len(rows)
        palette = plt.get_cmap("tab10")
        for j, cmd in enumerate(commands):
            vals = [r["round_trips_per_task"].get(cmd, 0.0) for r in rows]
            ax2.bar(names, vals, bottom=bottom, label=cmd.upper(), color=palette(j))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_ylabel("round trips to the lock Redis per task")
        ax2.set_title("Redis cost per task (lower is better)")
        ax2.legend(fontsize=8)
        ax2.tick_params(axis="x", labelsize=8)
        save(fig, "throughput")

        if all("cpu_us_per_task" in r for r in rows):
            fig, ax = plt.subplots(figsize=(8, 4.2))
            bottom = [0.0] * len(rows)
            for j, role in enumerate(CPU_ROLES):
                vals = [r["cpu_us_per_task"][role] for r in rows]
                ax.bar(names, vals, bottom=bottom, label=role, color=palette(j))
                bottom = [b + v for b, v in zip(bottom, vals)]
            for i, total in enumerate(bottom):
                ax.text(i, total, f"{total:.0f} µs", ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("CPU per task, µs (lower is better)")
            ax.set_title("Where the time goes: CPU per task by process")
            ax.legend(fontsize=8, loc="lower right")
            ax.tick_params(axis="x", labelsize=8)
            save(fig, "cpu")

    if "heartbeat" in results:
        hb = results["heartbeat"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["locks"] for r in hb]
        ax.plot(xs, [r["renew_ms_median"] for r in hb], marker="o", color=colours[
            "celery-singleton-lock"])
        for r in hb:
            ax.annotate(f"{r['commands_per_renewal']:g} call", (r["locks"], r["renew_ms_median"]),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(1000, color="#d6604d", linestyle="--", linewidth=1)
        ax.text(xs[0], 1000, " 1 second", color="#d6604d", va="bottom", fontsize=8)
        ax.set_xlabel("locks held by one worker process")
        ax.set_ylabel("one renewal of all of them (ms)")
        ax.set_title("Heartbeat: one Redis call per interval")
        save(fig, "heartbeat")

    if "latency" in results:
        lat = results["latency"]
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = ["acquire p50", "acquire p99", "release p50", "release p99"]
        width = 0.38
        for j, (name, ops) in enumerate(lat.items()):
            vals = [ops["acquire"]["p50_us"], ops["acquire"]["p99_us"],
                    ops["release"]["p50_us"], ops["release"]["p99_us"]]
            ax.bar([i + (j - 0.5) * width for i in range(4)], vals, width, label=name,
                   color=colours.get(name, "#4393c3"))
        ax.set_xticks(range(4), labels)
        ax.set_ylabel("microseconds (lower is better)")
        ax.set_title("Lock engine alone vs redis-py Lock, loopback")
        ax.legend()
        save(fig, "latency")

    if "storm" in results:
        s = results["storm"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(["skipped duplicates", "plain Celery tasks", "plain + one GET\n(a skip's floor)"],
               [s["skip_tasks_per_s"], s["plain_tasks_per_s"], s["one_trip_tasks_per_s"]],
               color=[colours["celery-singleton-lock"], colours["plain Celery"],
                      colours[FLOOR]])
        ax.set_ylabel("per second (higher is better)")
        ax.set_title(f"Duplicate storm: {s['deliveries']} deliveries, {s['keys']} keys; "
                     f"overlaps: {s['overlapping_executions']}", fontsize=10)
        save(fig, "storm")
    if "real" in results:
        save(_plot_real(plt, results["real"]), "real")
    if "capacity" in results:
        save(_plot_capacity(plt, results["capacity"]), "capacity")
    return written


def _plot_real(plt: Any, real: dict[str, Any]) -> Any:
    """Time against plain Celery per task and pool: median and rounds' range."""
    groups = [(kind, pool) for kind, _, _ in REAL_KINDS for pool in REAL_POOLS]
    rows = {(r["task"], r["pool"], r["config"]): r for r in real["rows"]}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for j, (label, colour) in enumerate(((REAL_CONFIGS[1][0], "#1b7837"),
                                         (FLOOR, "#4393c3"))):
        picked = [rows[(kind, pool, label)] for kind, pool in groups]
        mids = [r["time_ratio"] for r in picked]
        low = [m - min(r["time_ratios"]) for m, r in zip(mids, picked)]
        high = [max(r["time_ratios"]) - m for m, r in zip(mids, picked)]
        ax.bar([i + (j - 0.5) * width for i in range(len(groups))], mids, width,
               yerr=[low, high], capsize=3, label=label, color=colour)
    ax.axhline(1.0, color="#9e9e9e", linewidth=1)
    ax.axhline(1.02, color="#d6604d", linestyle="--", linewidth=1)
    ax.text(-0.5, 1.02, " 1.02x", color="#d6604d", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{kind}\n{pool}" for kind, pool in groups])
    ax.set_ylabel("time vs plain Celery, paired by round")
    ax.set_title("Tasks that do work: median and rounds' range (lower is better)")
    ax.legend(fontsize=8)
    return fig


def _plot_capacity(plt: Any, cap: dict[str, Any]) -> Any:
    rows = cap["rows"]
    names = [textwrap.fill(r["lock"], 16) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["ops_per_s"] for r in rows], 0.4,
            label=f"measured, {cap['client_processes']} client processes", color="#4393c3")
    ax1.bar([i + 0.2 for i in x], [r["ops_per_s_per_redis_core"] for r in rows], 0.4,
            label="one fully busy Redis core, at the measured CPU per operation",
            color="#1b7837")
    for i, r in enumerate(rows):
        ax1.text(i - 0.2, r["ops_per_s"], f"Redis {r['redis_utilisation']:.0%} busy",
                 ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("lock operations per second (acquire or release)")
    ax1.set_title("Capacity of one Redis (higher is better)")
    ax1.legend(fontsize=7, loc="lower right")
    inside = [r["redis_command_us_per_op"] for r in rows]
    around = [r["redis_cpu_us_per_op"] - r["redis_command_us_per_op"] for r in rows]
    ax2.bar(names, inside, label="inside the commands (INFO commandstats)", color="#762a83")
    ax2.bar(names, around, bottom=inside, label="the rest: sockets, event loop (/proc)",
            color="#c2a5cf")
    ax2.set_ylabel("Redis CPU µs per lock operation")
    ax2.set_title("Redis CPU per operation (lower is better)")
    ax2.tick_params(axis="x", labelsize=8)
    ax2.legend(fontsize=7)
    return fig


def profile(out: Path, calls: int = 3000) -> Path:
    """Profile SingletonTask's worker path in-process (acquire, run, release)."""
    from pyinstrument import Profiler

    server = Redis().start()
    try:
        os.environ.update({"BENCH_BROKER_URL": server.url(0), "BENCH_LOCK_URL": server.url(2)})
        from . import benchapp

        task = benchapp.app.tasks["bench.ours"]

        def one(i: int) -> None:
            task.push_request(id=uuid.uuid4().hex, hostname="bench", retries=0,
                              is_eager=False, called_directly=False, args=(i,), kwargs={})
            try:
                task(i)
            finally:
                task.pop_request()

        for i in range(200):
            one(i)
        profiler = Profiler(interval=0.0002)
        profiler.start()
        for i in range(calls):
            one(i)
        profiler.stop()
        path = out / "profile.txt"
        path.write_text(profiler.output_text(unicode=True, color=False, show_all=False))
        return path
    finally:
        server.stop()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the test suite")
    parser.add_argument("--profile", action="store_true", help="profile our worker path only")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="worker processes (default: 2)")
    parser.add_argument("--render", action="store_true",
                        help="only redraw the table and plots from OUT/results.json")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help="comma-separated sections to run, merged into OUT/results.json "
                             f"(default: all of {','.join(SECTIONS)})")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    sections = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = json.loads((args.out / "results.json").read_text())
        (args.out / "results.md").write_text(markdown(results))
        plots(results, args.out)
        print(markdown(results))
        return 0
    if args.profile:
        print(f"wrote {profile(args.out)}")
        return 0
    sizes = QUICK if args.quick else FULL
    if args.concurrency:
        sizes = dataclasses.replace(sizes, concurrency=args.concurrency)
    bench = Bench(sizes, args.out, sections)
    try:
        results = bench.run()
    finally:
        bench.close()
    results["mode"] = results["machine"]["mode"] = "quick" if args.quick else "full"
    previous = args.out / "results.json"
    if set(sections) != set(SECTIONS) and previous.exists():
        # the sections not run keep their last results; each run's machine record
        # is kept under the sections it measured
        merged = json.loads(previous.read_text())
        # a section run again replaces its last results, and its machine record
        runs = [m for m in merged.pop("partial_runs", [])
                if not set(m.get("sections", ())) <= set(sections)]
        results.pop("mode")
        runs.append(results.pop("machine"))
        merged.update(results, partial_runs=runs)
        results = merged
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    written = plots(results, args.out)
    print(table)
    print("wrote", ", ".join(str(p) for p in [args.out / "results.json",
                                              args.out / "results.md", *written]))
    return 0

def _ping(row: dict[str, Any], label: str) -> str:
    ping = row.get("ping_ms_while_renewing", {}).get(label)
    return f"{ping['p99']:.2f} / {ping['max']:.2f}" if ping else "-"


def ping_latency_while(port: int, work: Callable[[], Any], repeats: int) -> dict[str, float]:
    """p99 and max of a PING loop on its own connection while ``work`` runs
    ``repeats`` times (milliseconds)."""
    import socket as _socket

    samples: list[float] = []
    done = threading.Event()

    def pinger() -> None:
        with _socket.create_connection(("127.0.0.1", port)) as sock:
            while not done.is_set():
                started = time.perf_counter()
                sock.sendall(b"PING\r\n")
                sock.recv(64)
                samples.append((time.perf_counter() - started) * 1000)

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    time.sleep(0.05)
    for _ in range(repeats):
        work()
    done.set()
    thread.join(5)
    samples.sort()
    return {"p99": samples[int(len(samples) * 0.99)] if samples else 0.0,
            "max": samples[-1] if samples else 0.0}

if __name__ == "__main__":
    sys.exit(main())
