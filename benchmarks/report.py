"""The results as markdown: ``results.md``, one table or paragraph a section,
read from ``results.json`` alone (so ``--render`` redraws them)."""

from __future__ import annotations

import statistics
from typing import Any

from .harness import CPU_ROLES, FLOOR
from .real import REAL_CONFIGS
from .throughput import PEERS
from .userstyle import PEERS as USER_PEERS
from .userstyle import ROLES, TIMINGS, cpu_cell, timing_cell


def _ratio_range(row: dict[str, Any]) -> str:
    ratios = row.get("time_ratios") or [row["time_ratio"]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def markdown(results: dict[str, Any]) -> str:
    lines = []
    if "throughput" in results:
        t = results["throughput"]
        lines += [
            f"### Throughput ({t['tasks_per_batch']} trivial tasks per batch, "
            f"{t['rounds']} rounds, medians)", "",
            "| configuration | version | tasks/s | rounds' range | time vs plain Celery (median of "
            "rounds, range) | lock round "
            "trips per task (MONITOR) | lock commands per task, scripts' inner ones included "
            "(commandstats) | broker commands per task |",
            "|---|---|---:|---:|---:|---|---|---:|",
        ]
        for row in t["rows"]:
            cmds = ", ".join(f"{k.upper()} {v:.2g}"
                             for k, v in row["lock_commands_per_task"].items() if v >= 0.01) or "-"
            trips = ", ".join(f"{k.upper()} {v:.2g}"
                              for k, v in row["round_trips_per_task"].items() if v >= 0.01)
            trips = (f"**{row['round_trips_total_per_task']:.2g}**"
                     + (f" ({trips})" if trips else ""))
            per_round = [t["tasks_per_batch"] / x for x in row["batch_seconds"]]
            lines.append(f"| {row['config']} | {row['version']} | {row['tasks_per_s']:.0f} | "
                         f"{min(per_round):.0f}-{max(per_round):.0f} | "
                         f"{row['time_ratio']:.3f}x ({_ratio_range(row)}) | {trips} | {cmds} "
                         f"| {row['broker_calls_per_task']:.1f} |")
        floor = next((r for r in t["rows"] if r["config"] == FLOOR), None)
        if floor is not None and floor.get("time_ratios"):
            against = []
            for row in t["rows"]:
                if row is floor or row["config"] == "plain Celery" or not row.get("time_ratios"):
                    continue
                paired = [x / f for x, f in zip(row["time_ratios"], floor["time_ratios"])]
                against.append(f"{row['config']} {statistics.median(paired):.3f}x")
            lines += ["", "Time against the floor, paired by round (median): "
                      + ", ".join(against) + "."]
        if all("cpu_us_per_task" in row for row in t["rows"]):
            plain_cpu = sum(t["rows"][0]["cpu_us_per_task"].values())
            lines += [
                "", "### CPU per task, by process (µs, all rounds)", "",
                "| configuration | " + " | ".join(CPU_ROLES) + " | all | vs plain Celery |",
                "|---|" + "---:|" * (len(CPU_ROLES) + 2),
            ]
            for row in t["rows"]:
                per = row["cpu_us_per_task"]
                every = sum(per.values())
                lines.append(f"| {row['config']} | "
                             + " | ".join(f"{per[r]:.0f}" for r in CPU_ROLES)
                             + f" | {every:.0f} | {every - plain_cpu:+.0f} |")
        if all("lock_redis_keys_left_per_task" in row for row in t["rows"]):
            lines += [
                "", "Keys the lock Redis still holds once a batch is through, per task: "
                + ", ".join(f"{row['config']} {row['lock_redis_keys_left_per_task']:.2f}"
                            for row in t["rows"]) + "."]
        lines += _md_peers(t)
    if "real" in results:
        lines += _md_real(results["real"])
    if "storm" in results:
        s = results["storm"]
        lines += [
            "", f"### Duplicate storm ({s['deliveries']} deliveries over {s['keys']} keys)", "",
            "| measure | value |", "|---|---:|",
            f"| skipped duplicates processed per second | {s['skip_tasks_per_s']:.0f} |",
            f"| plain Celery tasks per second, same run | {s['plain_tasks_per_s']:.0f} |",
            f"| plain tasks asking Redis one bare GET, per second (a skip's floor) | "
            f"{s['one_trip_tasks_per_s']:.0f} |",
            f"| skips against plain tasks / against the skip's floor | "
            f"{s['skip_tasks_per_s'] / s['plain_tasks_per_s']:.2f}x / "
            f"{s['skip_tasks_per_s'] / s['one_trip_tasks_per_s']:.2f}x |",
            f"| racing executions (5 ms each) that ran | {s['racing_executions']} |",
            f"| racing deliveries skipped | {s['racing_skipped']} |",
            f"| **overlapping executions of one key** | **{s['overlapping_executions']}** |",
        ]
        if "cpu_us_per_delivery" in s:
            lines += [
                "", "CPU per delivery in the storm, by process (µs):", "",
                "| delivery | " + " | ".join(CPU_ROLES) + " | all |",
                "|---|" + "---:|" * (len(CPU_ROLES) + 1),
            ]
            for kind, per in s["cpu_us_per_delivery"].items():
                lines.append(f"| {kind} | "
                             + " | ".join(f"{per.get(r, 0.0):.0f}" for r in CPU_ROLES)
                             + f" | {sum(per.values()):.0f} |")
    if "heartbeat" in results:
        lines += [
            "", "### Heartbeat: one worker process holding N locks", "",
            "| locks held | one renewal (median ms) | worst of 5 (ms) | script calls per renewal "
            "(one round trip) | calls per heartbeat interval | locks lost "
            "| PING p99 / max while renewing (ms) | same, one call for all locks "
            "| Redis bytes per held lock | bytes left per released lock (for the lease "
            "and singleton_fence_ttl) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["heartbeat"]:
            lines.append(f"| {row['locks']:,} | {row['renew_ms_median']:.2f} | "
                         f"{row['renew_ms_max']:.2f} | {row['commands_per_renewal']:g} | "
                         f"{row['commands_per_interval']:g} | {row['lost']} | "
                         f"{_ping(row, 'chunked')} | {_ping(row, 'one call')} | "
                         f"{row.get('redis_bytes_per_held_lock', 0):.0f} | "
                         f"{row.get('redis_bytes_left_per_released_lock', 0):.0f} |")
    if "latency" in results:
        lines += ["", "### Lock latency on loopback (µs)", "",
                  "| lock | acquire p50 | acquire p99 | release p50 | release p99 |",
                  "|---|---:|---:|---:|---:|"]
        for name, ops in results["latency"].items():
            lines.append(f"| {name} | {ops['acquire']['p50_us']:.0f} | "
                         f"{ops['acquire']['p99_us']:.0f} | {ops['release']['p50_us']:.0f} | "
                         f"{ops['release']['p99_us']:.0f} |")
    if "userstyle" in results:
        lines += _md_userstyle(results["userstyle"])
    if "capacity" in results:
        lines += _md_capacity(results["capacity"])
    lines += ["", _md_machine(results["machine"])]
    for m in results.get("partial_runs", []):
        lines.append(f"Rerun of {', '.join(m.get('sections', []))}: " + _md_machine(m))
    lines.append("")
    return "\n".join(lines).lstrip("\n")


def _loads(m: dict[str, Any], key: str) -> str:
    return ", ".join(f"{x:.2f}" for x in m.get(key, [])) or "not recorded"


def _md_machine(m: dict[str, Any]) -> str:
    when = f", ending {m['date_utc']} UTC" if "date_utc" in m else ""
    model = f" ({m['cpu_model']})" if "cpu_model" in m else ""
    return (f"Machine: {m['cpus']} CPUs{model}, worker with {m.get('worker_processes', 2)} "
            f"processes, {m['platform']}, Python {m['python']}, "
            f"Redis {m['redis_server']}, Celery {m['celery']}, redis-py {m['redis_py']}; "
            f"load average (1, 5, 15 min) at the start {_loads(m, 'load_average_at_start')}, "
            f"at the end {_loads(m, 'load_average_at_end')}; the run took {m['seconds']} s"
            f"{when}.")


def _range(values: list[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def _md_peers(t: dict[str, Any]) -> list[str]:
    """Ours against each peer, sender and worker together, paired by round."""
    rows = {r["config"]: r for r in t["rows"]}
    ours = rows.get("celery-singleton-lock")
    if ours is None or "send_seconds" not in ours:
        return []
    n = t["tasks_per_batch"]
    lines = [
        "", "### End to end against each peer (sender and worker together)", "",
        "Each batch's time runs from the first `apply_async` to the last task finished, "
        "so it holds the sender's work (the peers take their lock there) and the worker's. "
        "Ratios are ours over the peer's, paired by round; CPU is every process of the run "
        "(worker main and pool, lock Redis, broker Redis, sender).", "",
        "| against | time, ours / theirs (median, rounds' range) | sending µs per task, ours "
        "/ theirs (median) | sender CPU µs per task, ours / theirs | all-process CPU µs per "
        "task, ours / theirs | ours - theirs per round (median, range) | ours at or below: "
        "time / CPU |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label in (*PEERS, FLOOR, "plain Celery"):
        peer = rows.get(label)
        if peer is None or "send_seconds" not in peer:
            continue
        ratios = [a / b for a, b in zip(ours["batch_seconds"], peer["batch_seconds"])]
        diffs = [sum(a.values()) - sum(b.values()) for a, b in
                 zip(ours["cpu_us_per_task_rounds"], peer["cpu_us_per_task_rounds"])]
        mine, theirs = sum(ours["cpu_us_per_task"].values()), sum(peer["cpu_us_per_task"].values())
        sending = (statistics.median(ours["send_seconds"]) / n * 1e6,
                   statistics.median(peer["send_seconds"]) / n * 1e6)
        snd = (ours["cpu_us_per_task"]["sending client"], peer["cpu_us_per_task"]["sending client"])
        verdict = (f"{'yes' if statistics.median(ratios) <= 1.0 else 'no'} / "
                   f"{'yes' if mine <= theirs else 'no'}")
        lines.append(
            f"| {label} | {statistics.median(ratios):.3f}x ({_range(ratios, '.2f')}) | "
            f"{sending[0]:.0f} / {sending[1]:.0f} | {snd[0]:.0f} / {snd[1]:.0f} | "
            f"{mine:.0f} / {theirs:.0f} | {statistics.median(diffs):+.0f} "
            f"({min(diffs):+.0f} to {max(diffs):+.0f}) | {verdict} |")
    return lines


def _md_real(real: dict[str, Any]) -> list[str]:
    lines = [
        "", f"### Tasks that do work ({real['rounds']} rounds, worker with "
        f"{real['worker_concurrency']} processes or threads)", "",
        "Batch time runs from the first send to the last task finished (every process "
        "of the run on the same cores); the time in the pool runs from `task_prerun` to "
        "`task_postrun` of each task (the lock's acquire and release are inside), the "
        "median over every task of every round.", "",
        "| task | pool | configuration | tasks per batch | tasks/s | batch time vs plain "
        "Celery (paired by round: median, range) | batch time vs the floor (paired: median, "
        "range) | time in the pool per task, median (p90) µs | over plain Celery | "
        "CPU µs per task, all processes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {(r["task"], r["pool"], r["config"]): r for r in real["rows"]}
    verdicts = []
    for row in real["rows"]:
        cpu = sum(row["cpu_us_per_task"].values())
        pool = "-"
        over = "-"
        if "pool_us_median" in row:
            plain = row["pool_us_median"] - row["pool_us_over_plain"]
            pool = f"{row['pool_us_median']:,.0f} ({row['pool_us_p90']:,.0f})"
            over = f"{row['pool_us_over_plain']:+.0f} ({row['pool_us_over_plain'] / plain:+.1%})"
        lines.append(
            f"| {row['task']} | {row['pool']} | {row['config']} | {row['tasks_per_batch']} | "
            f"{row['tasks_per_s']:.0f} | {row['time_ratio']:.3f}x "
            f"({_range(row['time_ratios'])}) | {row['floor_ratio']:.3f}x "
            f"({_range(row['floor_ratios'])}) | {pool} | {over} | {cpu:.0f} |")
        if row["config"] == REAL_CONFIGS[1][0] and "pool_us_median" in row:
            verdicts.append(_real_verdict(row, rows[(row["task"], row["pool"], FLOOR)],
                                          rows[(row["task"], row["pool"], "plain Celery")]))
    if verdicts:
        lines += ["", "Ours against the target (at most 1.02x plain Celery, and no more than "
                  "the floor), by each measure:", "",
                  "| task | pool | time in the pool, ours / floor over plain | all-process CPU, "
                  "ours / floor over plain | batch time, ours vs plain / vs floor |",
                  "|---|---|---|---|---|", *verdicts]
    return lines


def _real_verdict(ours: dict[str, Any], floor: dict[str, Any], plain: dict[str, Any]) -> str:
    def mark(ok: bool) -> str:
        return "met" if ok else "**missed**"

    base = plain["pool_us_median"]
    pool_o, pool_f = ours["pool_us_over_plain"] / base, floor["pool_us_over_plain"] / base
    cpu_p = sum(plain["cpu_us_per_task"].values())
    cpu_o = sum(ours["cpu_us_per_task"].values()) / cpu_p - 1
    cpu_f = sum(floor["cpu_us_per_task"].values()) / cpu_p - 1
    return (f"| {ours['task']} | {ours['pool']} | {pool_o:+.1%} / {pool_f:+.1%}: "
            f"{mark(pool_o <= 0.02 and pool_o <= pool_f)} | {cpu_o:+.1%} / {cpu_f:+.1%}: "
            f"{mark(cpu_o <= 0.02 and cpu_o <= cpu_f)} | {ours['time_ratio']:.3f}x / "
            f"{ours['floor_ratio']:.3f}x: "
            f"{mark(ours['time_ratio'] <= 1.02 and ours['floor_ratio'] <= 1.0)} |")


def _md_userstyle(u: dict[str, Any]) -> list[str]:
    """The user-style run: each condition a table, fastest first, and ours
    (and the floor of a lock taken in the worker) against the fastest peer."""
    lines = ["", f"### As a user measures ({u['tasks']} no-op tasks a batch counting themselves "
             f"with INCR, prefork -c 2, results ignored, {u['rounds']} rounds)", "",
             "| topology | prefetch | configuration | drain seconds (median) | rounds' range "
             "| time vs plain Celery (median of rounds) | CPU µs per task: all processes "
             f"({' / '.join(ROLES)}), medians | µs per task: {' / '.join(TIMINGS)}, medians |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    verdicts = []
    for cond in u["conditions"]:
        rows = sorted(cond["rows"], key=lambda r: r["median_seconds"])
        for row in rows:
            lines.append(f"| {cond['topology']} | {cond['prefetch']} | {row['config']} | "
                         f"{row['median_seconds']:.3f} | {_range(row['seconds'])} | "
                         f"{row['ratio_to_plain']:.3f} | {cpu_cell(row)} | {timing_cell(row)} |")
        ours = [r for r in rows if r["config"] == "celery-singleton-lock"]
        peers = [r for r in rows if r["config"] in USER_PEERS]
        if ours and peers:
            best = min(peers, key=lambda r: r["median_seconds"])
            mine = cond.get("ours_by_round")
            rounds = (f"; by round {mine['median']:.3f}, at or below both peers in "
                      f"{mine['won']} of {mine['rounds']}" if mine else "")
            floor = cond.get("floor_by_round")
            rounds += (f"; the floor by round {floor['median']:.3f}, at or below both in "
                       f"{floor['won']} of {floor['rounds']}" if floor else "")
            verdicts.append(f"{cond['topology']}, prefetch {cond['prefetch']}: ours "
                            f"{ours[0]['median_seconds'] / best['median_seconds']:.3f}x "
                            f"the fastest peer ({best['config']}){rounds}")
    if verdicts:
        lines += ["", "Ours against the fastest peer, by median drain time: "
                  + "; ".join(verdicts) + "."]
    return lines


def _md_capacity(cap: dict[str, Any]) -> list[str]:
    lines = [
        "", f"### Capacity of one Redis ({cap['client_processes']} client processes, "
        f"{cap['seconds_per_run']:g} s per lock per round, {cap['rounds']} rounds, medians)", "",
        "One lock operation is an acquire or a release, on a key no other call uses. "
        "Redis CPU from `/proc` (everything the server did, sockets included); command time "
        "from `INFO commandstats` (inside the commands the clients sent).", "",
        "| lock | acquire + release pairs/s | lock operations/s | rounds' range (ops/s) | "
        "lock Redis CPU busy | Redis CPU µs per operation | of which in commands (µs) | "
        "commands sent per pair | client CPU µs per operation | operations/s one busy "
        "Redis core would sustain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in cap["rows"]:
        ops = [2 * x for x in row["pairs_per_s_rounds"]]
        lines.append(
            f"| {row['lock']} | {row['pairs_per_s']:,.0f} | {row['ops_per_s']:,.0f} | "
            f"{_range(ops, ',.0f')} | {row['redis_utilisation']:.0%} | "
            f"{row['redis_cpu_us_per_op']:.1f} | {row['redis_command_us_per_op']:.1f} | "
            f"{row['redis_calls_per_pair']:.2g} | {row['client_cpu_us_per_op']:.0f} | "
            f"{row['ops_per_s_per_redis_core']:,.0f} |")
    return lines


def _ping(row: dict[str, Any], label: str) -> str:
    ping = row.get("ping_ms_while_renewing", {}).get(label)
    return f"{ping['p99']:.2f} / {ping['max']:.2f}" if ping else "-"
