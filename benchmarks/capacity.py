"""Capacity: lock operations per second one redis-server sustains.

Several client processes (``multiprocessing``, started with ``spawn`` so none
inherits the driver's threads or sockets) each take and free locks on keys no
other call uses, as fast as they can, for a fixed time, all against one
redis-server of the run's own. The server's CPU is read from ``/proc`` over
the same interval, and its per-command time from ``INFO commandstats``.

Three ways of taking a lock, alternated within each round:

- ours: ``LockEngine.acquire`` then ``LockEngine.release`` (one EVALSHA each);
- the floor: ``SET key 1 NX PX`` then ``DEL key`` through redis-py;
- redis-py's ``redis.lock.Lock``: ``acquire(blocking=False)`` then ``release()``.

``python -m benchmarks.capacity`` (:func:`main`) measures what a team plans
a lock Redis with and writes ``docs/capacity.md``: the above for ours on each
path, the floor and both peers (:data:`PAGE_KINDS`), then memory, bytes per
held lock, renewal cost and connections (:mod:`.capacityrun`).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any, Callable

import redis

from celery_singleton_lock.engine.request import Lease, Request

OURS = "celery-singleton-lock"
FLOOR = "floor: bare SET NX PX + DEL"
REDIS_PY = "redis-py Lock"
KINDS = (OURS, FLOOR, REDIS_PY)
#: ours forced onto each path, and the peers as their backends take and free
OURS_NATIVE = "celery-singleton-lock, native commands"
OURS_SCRIPTS = "celery-singleton-lock, scripts"
CELERY_SINGLETON = "celery-singleton"
CELERY_ONCE = "celery-once"
PAGE_KINDS = (OURS_NATIVE, OURS_SCRIPTS, FLOOR, CELERY_SINGLETON, CELERY_ONCE)
LEASE_MS = 60_000
# the commands each kind's client sends (the others run inside scripts, and
# INFO commandstats counts those too: OURS is measured on a server without the
# native commands, where it sends scripts only)
SENT = {OURS: {"evalsha"},
        FLOOR: {"set", "del"}, REDIS_PY: {"set", "evalsha"},
        OURS_NATIVE: {"set", "get", "time", "delifeq", "delex", "pexpire", "pttl"},
        OURS_SCRIPTS: {"evalsha"}, CELERY_SINGLETON: {"set", "del"},
        CELERY_ONCE: {"set", "del", "pttl"}}


def _pair(kind: str, url: str, tag: str) -> Callable[[int], None]:
    """One acquire + release of a key only call ``i`` of this client uses."""
    if kind in (CELERY_SINGLETON, CELERY_ONCE):
        return _peer(kind, url, tag)
    if kind in (OURS, OURS_NATIVE, OURS_SCRIPTS):
        from celery_singleton_lock import SingletonConfig
        from celery_singleton_lock.engine.registry import connect
        from celery_singleton_lock.keys import LockKeys

        native = "off" if kind == OURS_SCRIPTS else "auto"
        engine = connect(SingletonConfig.defaults(url, native=native))

        def ours(i: int) -> None:
            keys = LockKeys("cap:", f"{tag}{i:x}")
            exec_id = f"e{i}"
            got = engine.acquire(keys, Request(task_id=f"t{i}", exec_id=exec_id,
                                               lease=Lease.of_ms(LEASE_MS), hostname="capacity",
                                               retries=0, task_name="capacity",
                                               done=False))  # as the worker asks: no done window
            if got.status != 1:
                raise RuntimeError(f"not granted: {keys.base}")
            engine.release(keys, exec_id, f"t{i}")
        return ours
    client = redis.Redis.from_url(url)
    if kind == FLOOR:
        def floor(i: int) -> None:
            key = f"cap-floor:{tag}{i:x}"
            if not client.set(key, "1", nx=True, px=LEASE_MS):
                raise RuntimeError(f"not granted: {key}")
            client.delete(key)
        return floor

    def redis_py(i: int) -> None:
        lock = client.lock(f"cap-lock:{tag}{i:x}", timeout=LEASE_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"not granted: {lock.name!r}")
        lock.release()
    return redis_py


def _peer(kind: str, url: str, tag: str) -> Callable[[int], None]:
    """A peer's lock as its backend takes it and frees it (celery-singleton:
    ``SET NX EX``, ``DEL``; celery-once: redis-py's ``Lock``'s ``SET NX PX``,
    ``DEL``)."""
    if kind == CELERY_SINGLETON:
        from celery_singleton.backends.redis import RedisBackend

        backend = RedisBackend(url)

        def singleton(i: int) -> None:
            key = f"SINGLETONLOCK_cap.task{tag}{i:x}"
            if not backend.lock(key, f"t{i}", expiry=LEASE_MS // 1000):
                raise RuntimeError(f"not granted: {key}")
            backend.unlock(key)
        return singleton
    from celery_once.backends.redis import Redis as OnceRedis

    once = OnceRedis({"url": url, "default_timeout": LEASE_MS // 1000})

    def celery_once(i: int) -> None:
        key = f"qo_cap.task_{tag}{i:x}"
        once.raise_or_lock(key, timeout=LEASE_MS // 1000)  # raises when taken
        once.clear_lock(key)
    return celery_once


def client_process(conn: Connection, url: str, start: Any) -> None:
    """Runs jobs ``(kind, seconds)`` sent over ``conn`` until it receives None;
    answers each with the pairs done and this process's CPU seconds."""
    pairs: dict[str, Callable[[int], None]] = {}
    tag = uuid.uuid4().hex[:8]
    counter = 0
    while (job := conn.recv()) is not None:
        kind, seconds = job
        if kind not in pairs:
            pairs[kind] = _pair(kind, url, tag)
            for _ in range(50):  # connections open, scripts loaded
                pairs[kind](counter)
                counter += 1
        pair = pairs[kind]
        start.wait()  # everyone ready: the driver reads the server's counters
        start.wait()  # go
        cpu = time.process_time()
        deadline = time.monotonic() + seconds
        done = 0
        while time.monotonic() < deadline:
            for _ in range(20):
                pair(counter)
                counter += 1
            done += 20
        conn.send((done, time.process_time() - cpu))


def _cpu_seconds(pid: int) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick


def _usec(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command, from INFO commandstats."""
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for k, v in client.info("commandstats").items()}


class Clients:
    """The client processes, started early: they import while the run does
    something else, and wait for jobs."""

    def __init__(self, url: str, processes: int) -> None:
        self.url = url
        ctx = multiprocessing.get_context("spawn")
        self.start = ctx.Barrier(processes + 1)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=client_process, args=(theirs, url, self.start),
                               daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(ours)

    def stop(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()

    def measure(self, redis_pid: int, seconds: float, rounds: int,
                kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
        """Drive the server (process ``redis_pid``), ``seconds`` per kind per round."""
        info = redis.Redis.from_url(self.url)
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for r in range(rounds):
            # each round in another order, so no kind always follows the same one
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                samples[kind].append(self._one(info, redis_pid, kind, seconds))
                info.flushall()
        return summary(samples, len(self.procs), seconds, rounds, kinds)

    def _one(self, info: redis.Redis, redis_pid: int, kind: str,
             seconds: float) -> dict[str, float]:
        for conn in self.conns:
            conn.send((kind, seconds))
        self.start.wait(timeout=120)
        stats_before = _usec(info)
        cpu_before = _cpu_seconds(redis_pid)
        self.start.wait(timeout=10)
        began = time.monotonic()
        answers = [conn.recv() for conn in self.conns]
        wall = time.monotonic() - began
        redis_cpu = _cpu_seconds(redis_pid) - cpu_before
        stats = _usec(info)
        pairs = sum(a[0] for a in answers)
        # INFO commandstats: time inside the commands the clients sent (a
        # script's time includes its inner commands'), no socket reads and
        # writes, no event loop
        calls = {k: (c - stats_before.get(k, (0, 0))[0], us - stats_before.get(k, (0, 0))[1])
                 for k, (c, us) in stats.items() if k in SENT[kind]}
        return {
            "pairs": pairs,
            "seconds": wall,
            "pairs_per_s": pairs / wall,
            "redis_cpu_seconds": redis_cpu,
            "redis_utilisation": redis_cpu / wall,
            "redis_cpu_us_per_pair": redis_cpu / pairs * 1e6,
            "redis_command_us_per_pair": sum(us for _, us in calls.values()) / pairs,
            "redis_calls_per_pair": sum(c for c, _ in calls.values()) / pairs,
            "client_cpu_us_per_pair": sum(a[1] for a in answers) / pairs * 1e6,
        }


def summary(samples: dict[str, list[dict[str, float]]], processes: int, seconds: float,
            rounds: int, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    rows = []
    for kind in kinds:
        runs = samples[kind]

        def med(field: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[field] for r in runs)

        per_pair = med("redis_cpu_us_per_pair")
        rows.append({
            "lock": kind,
            "pairs_per_s": med("pairs_per_s"),
            "pairs_per_s_rounds": [r["pairs_per_s"] for r in runs],
            # one lock operation: an acquire or a release
            "ops_per_s": 2 * med("pairs_per_s"),
            "redis_utilisation": med("redis_utilisation"),
            "redis_utilisation_rounds": [r["redis_utilisation"] for r in runs],
            "redis_cpu_us_per_op": per_pair / 2,
            "redis_command_us_per_op": med("redis_command_us_per_pair") / 2,
            "redis_calls_per_pair": med("redis_calls_per_pair"),
            "client_cpu_us_per_op": med("client_cpu_us_per_pair") / 2,
            # what one fully busy Redis core would sustain at this CPU per operation
            "ops_per_s_per_redis_core": 2e6 / per_pair,
        })
    return {"client_processes": processes, "seconds_per_run": seconds, "rounds": rounds,
            "rows": rows, "samples": samples}


if __name__ == "__main__":
    from .capacityrun import main

    raise SystemExit(main())
