"""What the ``hiredis`` extra buys: CPU per lock acquire + release, in this
process, with redis-py's pure-Python reply parser and with hiredis's.

    python -m benchmarks.hiredis [--rounds 10] [--calls 3000]

Starts a redis-server of its own. Each round runs ``calls`` acquire + release
pairs through the lock engine (the same calls a worker makes) with one parser,
then with the other, alternating which goes first; CPU time is this process's
(``time.process_time``), so the server's work is not counted. Prints the median
per pair of each parser and their ratio.

The wire parses the lock calls' replies itself (``link.py``): run on a checkout
from before it (``PYTHONPATH=<checkout>``) to see what the parser changed then;
on this one the two settings differ only in what redis-py itself reads (the
connection's handshake).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import uuid
from typing import Any

import redis
import redis.connection

from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.testing import RedisServer

PARSERS: dict[str, Any] = {
    "python": getattr(redis.connection, "_RESP2Parser"),  # noqa: B009 (not exported)
    "hiredis": getattr(redis.connection, "_HiredisParser"),  # noqa: B009
}


def engine(url: str, parser: Any) -> LockEngine:
    config = SingletonConfig.defaults(url, redis_options={"parser_class": parser})
    return LockEngine.from_config(config)


def pairs(eng: LockEngine, calls: int) -> float:
    """CPU seconds per acquire + release pair."""
    keys = [LockKeys("bench:", uuid.uuid4().hex) for _ in range(calls)]
    start = time.process_time()
    for i, k in enumerate(keys):
        eng.acquire(k, Request(task_id=f"t{i}", exec_id=f"e{i}", lease=Lease.of_ms(30000),
                               hostname="bench", retries=0,
                               task_name="bench"))
        eng.release(k, f"e{i}", f"t{i}")
    return (time.process_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    with RedisServer() as server:
        engines = {name: engine(server.url(0), cls) for name, cls in PARSERS.items()}
        for eng in engines.values():
            pairs(eng, 200)  # warm up: connections, scripts
        samples: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                samples[name].append(pairs(engines[name], args.calls))
        info = server.client().info("server")
    med = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    for name, values in samples.items():
        lo, hi = min(values) * 1e6, max(values) * 1e6
        print(f"{name:8} {med[name]:7.1f} µs CPU per acquire+release (rounds {lo:.1f}-{hi:.1f})")
    print(f"hiredis / python: {med['hiredis'] / med['python']:.2f}x")
    print(f"{args.rounds} rounds x {args.calls} pairs, alternated; Python "
          f"{platform.python_version()}, redis-py {redis.__version__}, Redis "
          f"{info['redis_version']}, {platform.machine()}, {platform.system()}")


if __name__ == "__main__":
    main()
