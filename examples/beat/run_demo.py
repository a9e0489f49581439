"""Two `celery beat` processes and one worker: every tick sent exactly once.

    python examples/beat/run_demo.py

Starts a redis-server of its own on a free port, a worker, and two beats using
``celery_singleton_lock.beat:SingletonScheduler``; once the worker has run five
ticks, kills one beat with SIGKILL, stops at ten, and prints each tick with the
beat that sent it. Exits 0 only when every tick was sent exactly once with none missing.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from celery_singleton_lock.testing import RedisServer

HERE = Path(__file__).resolve().parent
SECONDS = 10


def ran(log: redis.Redis, ticks: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait until the worker has run ``ticks`` ticks (a minute at most)."""
    deadline = time.monotonic() + 60
    while log.llen("ticks") < ticks:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs[:1]):
            raise SystemExit(f"FAILED: {log.llen('ticks')} of {ticks} ticks ran within a minute")
        time.sleep(0.1)


def main() -> int:
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (apt-get install redis-server)")
        return 2
    workdir = tempfile.mkdtemp(prefix="beat-demo-")
    procs: list[subprocess.Popen[bytes]] = []
    # a free port of its own (another if that one is taken before it starts)
    server = RedisServer().start()
    try:
        port = server.port
        url = f"redis://127.0.0.1:{port}"
        log = redis.Redis.from_url(f"{url}/3", decode_responses=True)
        print(f"Started redis-server on port {port}")
        env = dict(os.environ, DEMO_REDIS_URL=url, PYTHONPATH=os.pathsep.join(
            [str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
        quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        celery = [sys.executable, "-m", "celery", "-A", "tasks"]
        procs.append(subprocess.Popen([*celery, "worker", "-P", "solo", "--loglevel", "WARNING",
                                       "--without-gossip", "--without-mingle"], env=env,
                                      cwd=workdir, start_new_session=True, **quiet))
        for n in (1, 2):
            procs.append(subprocess.Popen(
                [*celery, "beat", "-S", "celery_singleton_lock.beat:SingletonScheduler",
                 "-s", f"{workdir}/beat{n}-schedule", "--pidfile=", "--loglevel", "WARNING"],
                env=env, cwd=workdir, start_new_session=True, **quiet))
        # counted in ticks the worker ran, however slow the processes are to start
        ran(log, SECONDS // 2, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)  # beat 1: no goodbye, no lease to wait out
        print("kill -9 beat 1")
        ran(log, SECONDS, procs)
        os.killpg(procs[2].pid, signal.SIGKILL)
        events = [json.loads(x) for x in log.lrange("ticks", 0, -1)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
        server.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)

    counts = Counter(e["tick"] for e in events)
    for e in sorted(events, key=lambda e: e["tick"]):
        print(f"  tick {e['tick']}  sent by {e['beat']}")
    ticks = sorted(dt.datetime.fromisoformat(t) for t in counts)
    missing = [a for a, b in zip(ticks, ticks[1:]) if (b - a).total_seconds() != 1.0]
    twice = [t for t, n in counts.items() if n > 1]
    if len(ticks) < SECONDS - 2 or missing or twice:
        print(f"FAILED: {len(ticks)} ticks, sent twice: {twice}, gap after: {missing}")
        return 1
    print(f"Every one of {len(ticks)} ticks was sent exactly once, by two beats, one killed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
