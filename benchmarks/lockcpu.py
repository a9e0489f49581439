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

And, asked for by name (``--workloads ours,fcall``): fcall, ours' two scripts
as Redis Functions (Redis 7.0+) called with ``FCALL`` instead of ``EVALSHA``.

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
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import redis

from celery_singleton_lock.calls import SCRIPTS, acquire_call, release_call
from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine import LockEngine
from celery_singleton_lock.engines import connect
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.scripts import pack
from celery_singleton_lock.testing import free_port, redis_server_binary, wait_for

LEASE_MS = 30_000

#: redis-py's connection, whose methods carry no annotations
Connection: Any = redis.Connection


class Server:
    """A redis-server of this measurement's own; under callgrind if asked."""

    def __init__(self, callgrind: bool) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="lockcpu-")
        self.callgrind = callgrind
        binary = redis_server_binary()
        if binary is None:
            raise SystemExit("redis-server is not installed")
        self.binary = binary
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={self.dir}/callgrind.out.%p", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, decode_responses=True)
        wait_for(self._ping, 120, what="redis-server")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def version(self) -> str:
        return str(self.client.info("server")["redis_version"])

    def cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def commandstats(self) -> dict[str, tuple[int, float]]:
        raw = self.client.info("commandstats")
        return {name[len("cmdstat_"):]: (int(v["calls"]), float(v["usec"]))
                for name, v in raw.items()}

    def instructions(self, action: str) -> int:
        """``zero``: reset the counts; ``dump``: the instructions since then."""
        if action == "zero":
            subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True,
                           capture_output=True)
            subprocess.run(["callgrind_control", "-i", "on", str(self.proc.pid)], check=True,
                           capture_output=True)
            return 0
        subprocess.run(["callgrind_control", "-i", "off", str(self.proc.pid)], check=True,
                       capture_output=True)
        before = set(Path(self.dir).glob("callgrind.out.*"))
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True,
                       capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(Path(self.dir).glob("callgrind.out.*")) - before
            for path in sorted(new):
                match = re.search(r"^totals: (\d+)", path.read_text(), re.M)
                if match:
                    return int(match.group(1))
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def floor_workload(server: Server, tasks: int) -> Callable[[], None]:
    """SET NX PX before the task, DEL after: the least a lock can send."""
    conn = Connection(port=server.port)
    conn.connect()
    names = [f"singleton:{{{uuid.uuid4().hex}}}:lock" for _ in range(tasks)]

    def run() -> None:
        for name in names:
            conn.send_packed_command(
                [pack(["SET", name, "w1:1234:abcdef", "NX", "PX", LEASE_MS])], check_health=False)
            conn.read_response()
            conn.send_packed_command([pack(["DEL", name])], check_health=False)
            conn.read_response()
    return run


#: the least a lock written as scripts can do: take with ``SET NX PX``, free
#: only when the value is still ours (compare-and-delete)
BARE_TAKE = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0"
BARE_FREE = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
             "return redis.call('DEL', KEYS[1]) end return 0")
#: the bare take plus a fencing token that never goes down: the key's counter
#: + 1, floored at the server clock (as ours), kept after the lock is freed
FENCED_TAKE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('TIME')
local us = t[2]
local now = t[1] .. string.sub('00000', #us) .. us
local token = now
local last = redis.call('GET', KEYS[2])
if last and (#last > #now or (#last == #now and last >= now)) then
  token = string.format('%.0f', tonumber(last) + 1)
end
redis.call('SET', KEYS[2], token, 'PX', '86400000')
return token
"""


def redispy_workload(server: Server, tasks: int) -> Callable[[], None]:
    """redis-py's ``Lock``: ``SET NX PX`` to take it, a compare-and-delete
    script to free it (the cheapest lock that frees only its own key)."""
    client = redis.Redis(port=server.port)
    locks = [client.lock(f"singleton:{{{uuid.uuid4().hex}}}:lock", timeout=LEASE_MS / 1000)
             for _ in range(tasks)]
    warm = client.lock("singleton:{warm}:lock", timeout=LEASE_MS / 1000)
    warm.acquire(blocking=False)
    warm.release()

    def run() -> None:
        for lock in locks:
            if not lock.acquire(blocking=False):
                raise RuntimeError("redis-py's Lock was refused a free key")
            lock.release()
    return run


def bare_scripts_workload(server: Server, tasks: int, fenced: bool = False
                          ) -> Callable[[], None]:
    """Both steps as scripts doing nothing more than the floor and the owner
    check: the least any lock pays whose acquire and release are scripts.
    ``fenced``: the acquire also hands out a fencing token."""
    take = server.client.script_load(FENCED_TAKE if fenced else BARE_TAKE)
    free = server.client.script_load(BARE_FREE)
    conn = Connection(port=server.port)
    conn.connect()
    names = [f"singleton:{{{uuid.uuid4().hex}}}:" for _ in range(tasks)]

    def run() -> None:
        for base in names:
            name = base + "lock"
            keys = [2, name, base + "fence"] if fenced else [1, name]
            conn.send_packed_command(
                [pack(["EVALSHA", take, *keys, "w1:1234:abcdef", LEASE_MS])],
                check_health=False)
            if not conn.read_response():
                raise RuntimeError("the bare script lock was refused a free key")
            conn.send_packed_command([pack(["EVALSHA", free, 1, name, "w1:1234:abcdef"])],
                                     check_health=False)
            conn.read_response()
    return run


def _engine(server: Server) -> LockEngine:
    config = SingletonConfig.defaults(f"redis://127.0.0.1:{server.port}/0")
    return connect(config)


def ours_workload(server: Server, tasks: int) -> Callable[[], None]:
    """The engine's acquire and release, as the worker calls them for a task
    with the default settings (no done window)."""
    engine = _engine(server)
    calls = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]
    engine.acquire(calls[0][0], task_id="warm", exec_id="warm", lease_ms=LEASE_MS,
                   hostname="celery@bench", retries=0, task_name="bench.trivial", done=False)
    engine.release(calls[0][0], "warm", "warm")

    def run() -> None:
        for keys, task_id, exec_id in calls:
            engine.acquire(keys, task_id=task_id, exec_id=exec_id, lease_ms=LEASE_MS,
                           hostname="celery@bench", retries=0, task_name="bench.trivial",
                           done=False)
            engine.release(keys, exec_id, task_id)
    return run


def fcall_workload(server: Server, tasks: int) -> Callable[[], None]:
    """Ours' acquire.lua and release.lua unchanged, each the body of a Redis
    Function (``FUNCTION LOAD``, Redis 7.0+) called with ``FCALL`` instead of
    ``EVALSHA``, with the same KEYS and ARGV: what Functions would save."""
    library = "#!lua name=singleton_bench\n" + "".join(
        f"redis.register_function('singleton_{name}', function(KEYS, ARGV)\n"
        f"{SCRIPTS[name].source}\nend)\n" for name in ("acquire", "release"))
    server.client.function_load(library, replace=True)
    fin_ms = int(SingletonConfig.defaults("redis://").finished_ttl * 1000)  # as the engine's
    conn = Connection(port=server.port)
    conn.connect()
    calls = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]

    def fcall(name: str, keys: list[str], argv: list[Any]) -> Any:
        conn.send_packed_command([pack(["FCALL", f"singleton_{name}", len(keys), *keys,
                                        *argv])], check_health=False)
        return conn.read_response()

    def run() -> None:
        for keys, task_id, exec_id in calls:
            token = fcall("acquire", *acquire_call(
                keys, task_id, exec_id, LEASE_MS, "celery@bench", 0, "bench.trivial", "run",
                fin_ms, done=False))
            if not (isinstance(token, bytes) and token.isdigit()):
                raise RuntimeError(f"the FCALL acquire was refused a free key: {token!r}")
            fcall("release", *release_call(keys, exec_id, task_id, True, False, 0.0, fin_ms))
    return run


def skip_workload(server: Server, tasks: int) -> Callable[[], None]:
    """Acquires that find the key held by another task: the skipped duplicates
    (of a task with the default settings, as in :func:`ours_workload`)."""
    engine = _engine(server)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    ids = [uuid.uuid4().hex for _ in range(tasks)]

    def run() -> None:
        engine.acquire(keys, task_id="holder", exec_id="holder:1", lease_ms=LEASE_MS * 10,
                       hostname="celery@bench", retries=0, task_name="bench.trivial")
        for task_id in ids:
            engine.acquire(keys, task_id=task_id, exec_id=task_id, lease_ms=LEASE_MS,
                           hostname="celery@bench", retries=0, task_name="bench.trivial",
                           done=False)
    return run


def get_workload(server: Server, tasks: int) -> Callable[[], None]:
    """One bare GET per task: a skip's floor."""
    conn = Connection(port=server.port)
    conn.connect()
    server.client.set("singleton:{held}:lock", "x")

    def run() -> None:
        for _ in range(tasks):
            conn.send_packed_command([pack(["GET", "singleton:{held}:lock"])], check_health=False)
            conn.read_response()
    return run


WORKLOADS: dict[str, Callable[[Server, int], Callable[[], None]]] = {
    "floor": floor_workload, "ours": ours_workload, "skip": skip_workload, "get": get_workload,
    "redispy": redispy_workload, "scripts": bare_scripts_workload,
    "fenced": lambda server, tasks: bare_scripts_workload(server, tasks, fenced=True),
    "fcall": fcall_workload,
}


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
    from celery_singleton_lock.calls import SCRIPTS

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
    print(f"redis {version} ({server.binary}), {args.tasks} tasks x {args.rounds} rounds, "
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
