"""Where the lock Redis spends its time: our acquire + release against the floor.

    python -m benchmarks.lockcpu                   # CPU of the server, many rounds
    python -m benchmarks.lockcpu --callgrind       # instructions, under valgrind
    python -m benchmarks.lockcpu --tasks 20000 --rounds 9

One "task" is what the lock Redis sees for one trivial task in the worker:

* ours:  ``LockEngine.acquire`` then ``LockEngine.release`` (one EVALSHA each),
  every task on a key of its own, as in the throughput benchmark;
* floor: ``SET <key> <exec id> NX PX <lease>`` then ``DEL <key>``.
* skip:  an acquire that finds the key held (what a skipped duplicate costs).

Two references bound what any lock can cost, next to ours and the floor:

* redispy: redis-py's ``Lock``: ``SET NX PX``, then its release script
  (``GET``, compare, ``DEL``): the cheapest lock that frees only its own key;
* scripts: both steps as scripts that do only that (``SET NX PX`` in one,
  compare-and-delete in the other): the least any lock pays whose acquire
  and release are scripts, as ours are (no owner record, no fencing token,
  no markers);
* fenced: the same with a fencing token that never goes down (the key's
  counter + 1, floored at the server clock, as ours): the least a lock pays
  that keeps its fencing tokens.

And, asked for by name (``--workloads ours,fcall,hashfield``): fcall, ours'
two scripts as Redis Functions (Redis 7.0+) called with ``FCALL`` instead of
``EVALSHA``; hashfield, the owner record as a field named by the execution id
in a hash, freed with a plain ``HDEL`` (a layout ours does not use: what it
would save).

Both are written the same way on one connection (one round trip per command),
so the client's own work does not enter: only the server's. The redis-server is
started here, on a free loopback port, and emptied between workloads. Reported
per task, median over rounds (the workloads alternate within each round):

* CPU of the server process (``INFO cpu``: ``used_cpu_sys + used_cpu_user``
  deltas), noisy on a shared machine, hence the rounds;
* ``INFO commandstats`` deltas: calls and microseconds per command;
* with ``--callgrind``: instructions the server executes (valgrind's callgrind,
  counts zeroed and dumped around each workload with ``callgrind_control``),
  which do not depend on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from typing import Any, Optional

from .lockserver import Server
from .lockworkloads import WORKLOADS, ours_workload


def measure(server: Server, name: str, tasks: int, callgrind: bool) -> dict[str, Any]:
    server.client.flushall()
    run = WORKLOADS[name](server, tasks)
    stats0 = server.commandstats()
    if callgrind:
        server.instructions("zero")
    cpu0 = server.cpu()
    run()
    cpu1 = server.cpu()
    instructions = server.instructions("dump") if callgrind else 0
    stats1 = server.commandstats()
    commands = {}
    for cmd, (calls, usec) in stats1.items():
        calls0, usec0 = stats0.get(cmd, (0, 0.0))
        if cmd == "info":
            continue  # the measurement's own
        if calls > calls0:
            commands[cmd] = ((calls - calls0) / tasks, (usec - usec0) / (calls - calls0))
    return {"cpu_us": (cpu1 - cpu0) * 1e6 / tasks, "instructions": instructions / tasks,
            "commands": commands}


def per_script(server: Server, tasks: int) -> dict[str, tuple[float, float]]:
    """Microseconds each script call takes inside Redis (its inner commands
    included), from the slow log with every command logged: (median, p90)."""
    from celery_singleton_lock.engine.calls import SCRIPTS

    names = {script.sha: name for name, script in SCRIPTS.items()}
    client = server.client
    client.flushall()
    run = ours_workload(server, tasks)
    client.config_set("slowlog-max-len", 4 * tasks)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    run()
    entries = client.slowlog_get(4 * tasks)
    client.config_set("slowlog-log-slower-than", 10_000)
    durations: dict[str, list[int]] = {}
    for entry in entries:
        command = entry["command"]
        words = (command.decode() if isinstance(command, bytes) else str(command)).split(" ")
        if words[0].upper() == "EVALSHA" and len(words) > 1 and words[1] in names:
            durations.setdefault(names[words[1]], []).append(int(entry["duration"]))
    return {name: (statistics.median(d), statistics.quantiles(d, n=10)[-1])
            for name, d in durations.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per workload and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true",
                        help="count the server's instructions under valgrind (slow: use "
                             "--tasks 2000 --rounds 1; they repeat exactly)")
    parser.add_argument("--workloads", default="floor,ours,redispy,scripts,fenced,get,skip")
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    server = Server(args.callgrind)
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        version = server.version()
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                results[name].append(measure(server, name, args.tasks, args.callgrind))
        scripts = per_script(server, 2000) if not args.callgrind else {}
    finally:
        server.stop()
    print(f"{version} ({server.binary}), {args.tasks} tasks x {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, {platform.platform()}, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    floor = statistics.median(r["cpu_us"] for r in results.get("floor", [])) if (
        "floor" in results) else None
    get = statistics.median(r["cpu_us"] for r in results.get("get", [])) if (
        "get" in results) else None
    for name in names:
        rows = results[name]
        cpu = statistics.median(r["cpu_us"] for r in rows)
        spread = f"{min(r['cpu_us'] for r in rows):.1f}-{max(r['cpu_us'] for r in rows):.1f}"
        line = f"{name:7} server CPU per task {cpu:6.1f} us (rounds {spread})"
        base = get if name == "skip" else floor
        if base and name not in ("floor", "get"):
            line += f"  {cpu / base:.2f}x {'get' if name == 'skip' else 'floor'}"
        if args.callgrind:
            per_task = statistics.median(r["instructions"] for r in rows)
            line += f"  instructions per task {per_task:,.0f}"
        print(line)
        last = rows[-1]["commands"]
        print("        " + ", ".join(f"{cmd} {calls:g} ({usec:.2f} us)"
                                    for cmd, (calls, usec) in sorted(last.items())))
    for name, (median, p90) in sorted(scripts.items()):
        print(f"script {name}: {median:.0f} us median, {p90:.0f} us p90 inside Redis (slow log)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
