"""How long a beat is between claiming a tick and having sent it: the window
in which a beat that dies loses that tick (docs/beat.md, "Known limits").

    python -m benchmarks.beatwindow [--rows 10] [--seconds 60]

Two real ``celery beat`` processes run django-celery-beat's scheduler on a
PostgreSQL database of the run's own (127.0.0.1:5432, user postgres, trust
auth; created and dropped), under ``SingletonSchedulerMixin``, with a
redis-server of the run's own as broker and lock Redis. ``--rows`` interval
rows of 1 s each, for ``--seconds`` from the first tick sent (and until
``--ticks`` were sent). For each tick a beat sends, the beat
notes (:mod:`benchmarks.beatwindowapp`) the claim's round trip (``SET NX PX``)
and the window from its answer to the return of the message's publish, which
holds the row's re-read (``refresh_from_db``) and the overlap check. Prints
the distribution and checks that every tick was sent once (the messages'
tick headers, read back from the broker).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from celery_singleton_lock.testing import wait_for

from .servers import ROOT, Redis


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="how long the beats run, from the first tick sent")
    parser.add_argument("--ticks", type=int, default=1,
                        help="and until at least this many ticks are sent")
    args = parser.parse_args()

    import psycopg

    admin = psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres "
                            "connect_timeout=3", autocommit=True)
    name = f"bw_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    server = Redis().start()
    record = Path(tempfile.mkstemp(prefix="beatwindow-", suffix=".jsonl")[1])
    beats: list[subprocess.Popen[bytes]] = []
    try:
        env = {**os.environ, "BW_PG_DSN": f"host=127.0.0.1 port=5432 user=postgres dbname={name}",
               "BW_REDIS_URL": server.url(0).rsplit("/", 1)[0], "BW_RECORD": str(record),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-m", "benchmarks.beatwindowapp", "seed",
                        str(args.rows)], env=env, cwd=ROOT, check=True, timeout=120)
        load_before = os.getloadavg()
        logs = []
        for n in range(2):
            log = open(Path(tempfile.gettempdir()) / f"beatwindow-{name}-{n}.log", "wb")  # noqa: SIM115
            logs.append(log)
            beats.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "benchmarks.beatwindowapp:app", "beat",
                 "-S", "benchmarks.beatwindowapp:TimedScheduler", "--loglevel", "WARNING",
                 "--pidfile=", "--max-interval", "1"],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: record.stat().st_size > 0, 120, what="the first tick sent")
        first = time.monotonic()
        wait_for(lambda: time.monotonic() - first >= args.seconds
                 and len(record.read_text().splitlines()) >= args.ticks,
                 args.seconds + 120, what=f"{args.ticks} ticks sent", interval=0.2)
        load_after = os.getloadavg()
    finally:
        for beat in beats:
            beat.terminate()
        for beat in beats:
            beat.wait(30)
        messages = [json.loads(m) for m in server.client(0).lrange("beatwindow", 0, -1)]
        server.stop()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    record.unlink()
    window = [r["window_ms"] for r in runs]
    claim = [r["claim_ms"] for r in runs]
    by_beat = {b: sum(r["beat"] == b for r in runs) for b in {r["beat"] for r in runs}}
    ticks = [(m["headers"]["singleton_beat_entry"], m["headers"]["singleton_beat_tick"])
             for m in messages]
    assert len(set(ticks)) == len(ticks) == len(runs), "a tick sent twice, or a send untimed"
    lines = [
        f"{len(runs)} ticks sent by 2 beats ({sorted(by_beat.values())}), {args.rows} rows "
        f"of 1 s, {args.seconds:g} s from the first send; {platform.python_version()}, "
        f"{os.cpu_count()} cores, load {load_before[0]:.1f} -> {load_after[0]:.1f}",
        "",
        "| ms | median | p90 | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for label, values in (("claim round trip (SET NX PX)", claim),
                          ("claim answered -> publish returned", window),
                          ("claim asked -> publish returned",
                           [c + w for c, w in zip(claim, window)])):
        lines.append(f"| {label} | {statistics.median(values):.2f} | "
                     f"{percentile(values, 0.9):.2f} | {percentile(values, 0.99):.2f} | "
                     f"{max(values):.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
