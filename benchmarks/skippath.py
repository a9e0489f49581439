"""CPU of a skipped duplicate in the worker's pool process, against plain + one GET.

    python -m benchmarks.skippath                 # 5 rounds of 3,000 calls each
    python -m benchmarks.skippath --profile       # pyinstrument of the skip path

Each call goes through Celery's own tracer (``build_tracer``, as a pool process
runs a task: signals, ``saferepr`` of the result, the ``Ignore`` handling), in
this process, against a redis-server started here:

* ``plain+GET``: a plain task that sends one bare ``GET`` to the lock Redis
  (a skip's floor: a duplicate is known only after asking Redis);
* ``skip``: a ``SingletonTask`` whose key another task holds (the skip result);
* ``skip -E``: the same with task events on, as with ``celery worker -E``
  (the result stored, a ``task-skipped`` event, ``Ignore``).

Process CPU per call (``time.process_time``), median of rounds, the workloads
alternating within each round. The broker and result backend are the same
redis-server, so storing a result and sending an event cost what they cost.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import uuid
from typing import Any, Callable, Optional

from celery import Celery
from celery.app.trace import build_tracer

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.engine.registry import engine_for
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.observe.monitor import NODE
from celery_singleton_lock.testing import RedisServer


def make_app(server: RedisServer) -> tuple[Celery, Any, Any]:
    app = Celery("skippath", broker=server.url(0), backend=server.url(1),
                 set_as_current=False)
    # as the benchmark's app: no results kept (a message says so in its headers)
    app.conf.update(task_ignore_result=True, singleton_redis_url=server.url(2))
    lock_redis = server.client(2)

    @app.task(name="skippath.plain")
    def plain(key: str) -> int:
        lock_redis.get("skippath:none")
        return 1

    @app.task(name="skippath.dup", base=SingletonTask, singleton_key=("key",))
    def dup(key: str) -> int:
        return 1

    return app, plain, dup


def runner(app: Celery, task: Any, key: str) -> Callable[[], None]:
    tracer = build_tracer(task.name, task, app=app, hostname="skippath@bench", eager=False)

    def one() -> None:
        task_id = uuid.uuid4().hex
        tracer(task_id, (key,), {}, {"id": task_id, "hostname": "skippath@bench",
                                     "delivery_info": {}, "headers": {}, "retries": 0,
                                     "ignore_result": True})
    return one


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        app, plain, dup = make_app(server)
        key = "held"
        engine = engine_for(app)
        keys = dup.singleton_keys(key)
        engine.acquire(keys, Request(task_id="holder", exec_id="holder:1",
                                     lease=Lease.of_ms(3_600_000), hostname="skippath@bench",
                                     retries=0, task_name=dup.name))
        workloads = {"plain+GET": runner(app, plain, key), "skip": runner(app, dup, key)}
        NODE.worker = True  # as in a pool process: the worker step said whether -E is on

        def with_events() -> Callable[[], None]:
            one = workloads["skip"]

            def run() -> None:
                NODE.task_events = True
                try:
                    one()
                finally:
                    NODE.task_events = False
            return run
        workloads["skip -E"] = with_events()
        for one in workloads.values():  # warm: connections, scripts, imports
            for _ in range(200):
                one()
        if args.profile:
            from pyinstrument import Profiler
            for name in ("skip", "skip -E"):
                profiler = Profiler(interval=0.0001)
                profiler.start()
                for _ in range(args.calls):
                    workloads[name]()
                profiler.stop()
                print(f"== {name}")
                print(profiler.output_text(unicode=True, color=False, show_all=False))
            return
        results: dict[str, list[float]] = {n: [] for n in workloads}
        for round_ in range(args.rounds):
            names = list(workloads) if round_ % 2 == 0 else list(workloads)[::-1]
            for name in names:
                one = workloads[name]
                cpu0 = time.process_time()
                for _ in range(args.calls):
                    one()
                results[name].append((time.process_time() - cpu0) * 1e6 / args.calls)
    print(f"{args.calls} calls x {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"{platform.platform()}, Python {platform.python_version()}, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base = statistics.median(results["plain+GET"])
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:10} {median:7.1f} us CPU per call (rounds {min(values):.1f}-"
              f"{max(values):.1f}), {median / base:.2f}x plain+GET")


if __name__ == "__main__":
    main()
