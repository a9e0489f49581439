"""Heartbeat scaling: one worker process holding N locks; how long one renewal
of all of them takes, the calls it makes, what another client of the Redis
sees meanwhile, and the bytes a lock uses while held and once released."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from typing import Any, Callable

from .harness import Bench, commandstats, delta


def key_bytes(client: Any, keys: list[str]) -> float:
    """Mean ``MEMORY USAGE`` of the keys that exist (0 when none does)."""
    sizes = [client.memory_usage(k, samples=0) for k in keys]
    found = [x for x in sizes if x is not None]
    return sum(found) / len(found) if found else 0.0


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


def measure(bench: Bench) -> None:
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.request import Lease, Request
    from celery_singleton_lock.engine.server import RENEW_CHUNK, LockEngine
    from celery_singleton_lock.keys import LockKeys
    from celery_singleton_lock.lock import SingletonLock
    from celery_singleton_lock.worker.heartbeat import Heartbeat

    engine = LockEngine.from_config(SingletonConfig.defaults(bench.locks.url(5)))
    client = bench.locks.client(5)
    rows = []
    for n in bench.sizes.heartbeat:
        client.flushdb()
        locks = []
        for i in range(n):
            keys = LockKeys("bench:", f"{i:032x}")
            got = engine.acquire(keys, Request(f"t{i}", f"e{i}", Lease(60.0), "bench",
                                               task_name="bench"))
            locks.append(SingletonLock(keys, task_id=f"t{i}", exec_id=f"e{i}",
                                       token=got.token, lease=60.0,
                                       started=time.monotonic(), held=True))
        sample = [lk.keys for lk in locks[:50]]
        held_bytes = (key_bytes(client, [k.lock for k in sample])
                      + key_bytes(client, [k.fence for k in sample]))
        entries = [(lk.keys.lock, lk.exec_id, 60_000) for lk in locks]
        engine.renew(entries)  # the first call also loads the script
        durations = []
        before = commandstats(bench.lock_client)
        repeats = 5
        for _ in range(repeats):
            started = time.perf_counter()
            engine.renew(entries)
            durations.append(time.perf_counter() - started)
        calls = delta(before, commandstats(bench.lock_client)).get("evalsha", 0)
        # what another client of this Redis sees while the locks renew: PING
        # latency, chunked renewals against one call for every lock
        stall = {}
        for label, chunk in (("chunked", engine.renew_chunk), ("one call", max(n, 1))):
            engine.renew_chunk = chunk
            stall[label] = ping_latency_while(
                bench.locks.port, functools.partial(engine.renew, entries), repeats)
        engine.renew_chunk = RENEW_CHUNK
        # the real renewer: rounds and commands over a few intervals of a 0.3 s lease
        hb = Heartbeat(engine)
        for lk in locks:
            lk.lease = Lease(0.3)
            hb.add(lk)
        # count whole rounds only: start right after one ends, stop once the
        # last one in flight has ended
        first = hb.rounds
        while hb.rounds == first:
            time.sleep(0.001)
        rounds_before = hb.rounds
        before = commandstats(bench.lock_client)
        time.sleep(1.0)
        lost = sum(1 for lk in locks if lk.lost)  # while still renewed
        for lk in locks:
            hb.discard(lk)
        time.sleep(0.4)
        hb_calls = delta(before, commandstats(bench.lock_client)).get("evalsha", 0)
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
    bench.results["heartbeat"] = rows
