"""What every section of ``python -m benchmarks.run`` shares: the sizes, the
servers and worker a run starts, batches timed end to end, the CPU of each
process read from ``/proc``, Redis's own command counters and percentiles."""

from __future__ import annotations

import os
import platform
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from . import capacity
from .servers import Redis, Worker


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
    user_tasks: int     # tasks per batch of the user-style run
    user_rounds: int
    concurrency: int = 2


FULL = Sizes(tasks=1000, rounds=9, heartbeat=(1, 100, 1000, 10000), storm=4000, storm_keys=4,
             latency=5000, real_io=300, real_cpu=80, real_rounds=9, capacity_processes=6,
             capacity_seconds=3.0, capacity_rounds=3, user_tasks=3000, user_rounds=4)
QUICK = Sizes(tasks=40, rounds=1, heartbeat=(1, 100), storm=60, storm_keys=2, latency=200,
              real_io=10, real_cpu=4, real_rounds=1, capacity_processes=2,
              capacity_seconds=0.25, capacity_rounds=1, user_tasks=40, user_rounds=1)

SECTIONS = ("throughput", "userstyle", "storm", "heartbeat", "latency", "real", "capacity")

# connection set-up, not part of a task's cost
SETUP_COMMANDS = {"hello", "client", "ping", "script", "info", "select", "echo", "auth"}

FLOOR = "floor: bare SET NX + DEL"


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


def _schedstat_us(path: str) -> tuple[float, float]:
    """One thread's run time and wait for a CPU so far, µs ((0, 0) if unreadable)."""
    try:
        with open(path) as fh:
            ran, waited = fh.read().split()[:2]
    except OSError:
        return 0.0, 0.0
    return int(ran) / 1e3, int(waited) / 1e3


def sched_us(pids: list[int]) -> tuple[float, float]:
    """Microseconds the processes' threads ran so far, and waited runnable for a
    CPU (the kernel's schedstat; (0, 0) where it cannot be read)."""
    ran = waited = 0.0
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            r, w = _schedstat_us(f"/proc/{pid}/task/{tid}/schedstat")
            ran, waited = ran + r, waited + w
    return ran, waited


def thread_us(pid: int) -> tuple[float, float]:
    """:func:`sched_us` of a process's main thread alone (the one that hands
    out a Celery worker's messages)."""
    return _schedstat_us(f"/proc/{pid}/schedstat")


def command_us(clients: list[Any]) -> float:
    """Microseconds the Redis servers spent inside commands so far (``INFO
    commandstats``: what the commands cost, apart from reading and writing sockets)."""
    return float(sum(int(v["usec"]) for client in clients
                     for v in client.info("commandstats").values()))


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


CPU_ROLES = ("worker main process", "worker pool processes", "lock Redis", "broker Redis",
             "sending client")


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
    """The servers and workers of one run, and the batches every section times."""

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
        # every section measured already: no warm shutdown to wait for
        for worker in (self.threads, self.worker):
            if worker is not None:
                worker.kill_all()
                worker.stop()
        self.broker.stop()
        self.locks.stop()

    # -- helpers -----------------------------------------------------------------

    def lock_keys(self) -> int:
        """Keys in the lock Redis, the workers' published counters and held-lock
        lists left out (each pool process writes them once a second, and the
        held list vanishes whenever it empties)."""
        from celery_singleton_lock.config import get_config
        from celery_singleton_lock.observe.monitor import held_key, stats_key

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
        from celery_singleton_lock.observe.monitor import held_key, stats_key

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
