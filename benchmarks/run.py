"""Measure celery-singleton-lock beside plain Celery and the libraries users pick today.

    python -m benchmarks.run              # the full run (about 15 minutes on 2 cores)
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
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from . import heartbeat, latency, real, storm, throughput, userstyle
from .harness import FULL, QUICK, SECTIONS, Bench, cpu_model, version
from .plots import plots
from .report import markdown
from .servers import ROOT, Redis


def measure_capacity(bench: Bench) -> None:
    """Lock operations per second one Redis sustains (``benchmarks/capacity.py``)."""
    assert bench.clients is not None and bench.capacity_redis is not None
    assert bench.capacity_redis.proc is not None
    bench.results["capacity"] = bench.clients.measure(
        bench.capacity_redis.proc.pid, bench.sizes.capacity_seconds, bench.sizes.capacity_rounds)


def measure_userstyle(bench: Bench) -> None:
    """The run a user comparing libraries writes (``benchmarks/userstyle.py``):
    counting inside the task, prefetch 4 and 8, one Redis or a lock Redis of its own."""
    bench.results["userstyle"] = userstyle.run(bench.sizes.user_tasks, bench.sizes.user_rounds)


# what each section runs, by name
MEASURES: dict[str, Callable[[Bench], None]] = {
    "throughput": throughput.measure,
    "userstyle": measure_userstyle,
    "storm": storm.measure,
    "heartbeat": heartbeat.measure,
    "latency": latency.measure,
    "real": real.measure,
    "capacity": measure_capacity,
}


def measure(bench: Bench) -> dict[str, Any]:
    started = time.monotonic()
    load_at_start = list(os.getloadavg())
    took: dict[str, float] = {}
    for section in SECTIONS:
        if section in bench.sections:
            began = time.monotonic()
            MEASURES[section](bench)
            took[section] = round(time.monotonic() - began, 1)
    bench.results["machine"] = {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_at_start": load_at_start,
        "sections": list(bench.sections),
        "section_seconds": took,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis_server": bench.lock_client.info("server")["redis_version"],
        "celery": version("celery"),
        "redis_py": version("redis"),
        "load_average_at_end": list(os.getloadavg()),
        "worker_processes": bench.sizes.concurrency,
        "seconds": round(time.monotonic() - started, 1),
    }
    return bench.results


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
        results = measure(bench)
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


if __name__ == "__main__":
    sys.exit(main())
