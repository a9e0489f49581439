"""The distance run's results (``benchmarks/distance.py``) as a markdown table,
a plot, and the section of ``docs/capacity.md`` on a lock Redis far away; each
from the JSON alone, an earlier run's beside it when given."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional

#: the kind every other is set against
PLAIN = "plain Celery"
#: the RTT the one-column figures are read at, ms
HEADLINE_RTT = 20.0

COLOURS = {"plain Celery": "#9e9e9e", "ours, scripts": "#1b7837", "ours, native": "#5aae61",
           "ours, singleton_limit=2": "#a6dba0", "ours, queue_and_run": "#00441b",
           "ours, Cluster": "#35978f", "ours, Redlock": "#01665e",
           "floor: SET NX PX + DEL": "#4393c3", "celery-singleton": "#c2a5cf",
           "celery-once": "#762a83"}


def _rtts(results: dict[str, Any]) -> list[str]:
    return sorted(results["rows"][0]["by_rtt"], key=float)


def _row(results: Optional[dict[str, Any]], kind: str) -> Optional[dict[str, Any]]:
    if results is None:
        return None
    return next((r for r in results["rows"] if r["kind"] == kind), None)


def _at(results: Optional[dict[str, Any]], kind: str, rtt: str) -> Optional[dict[str, Any]]:
    row = _row(results, kind)
    return None if row is None else row["by_rtt"].get(rtt)


def headline(results: dict[str, Any]) -> str:
    """The RTT the one-column figures are read at: 20 ms, else the largest run."""
    rtts = _rtts(results)
    return str(HEADLINE_RTT) if str(HEADLINE_RTT) in rtts else rtts[-1]


def trips_cell(cell: Optional[dict[str, Any]]) -> str:
    if cell is None:
        return "-"
    sender = cell["sender_round_trips"]
    if abs(sender) < 0.05:
        return f"{cell['round_trips']:.2f}"
    sign = "+" if sender >= 0 else "-"
    return (f"{cell['round_trips']:.2f} ({cell['worker_round_trips']:.2f} {sign} "
            f"{abs(sender):.2f} at send)")


def how(results: dict[str, Any]) -> str:
    m, sizes = results["machine"], results["sizes"]
    servers = results["servers"]
    added = ", ".join(f"{float(r):g} ms: {min(c['added_ms_by_relay'].values()):.2f}-"
                      f"{max(c['added_ms_by_relay'].values()):.2f}"
                      for r, c in sorted(results["calibration"].items(), key=lambda x: float(x[0])))
    return (f"{sizes['tasks']} no-op tasks per batch, {sizes['rounds']} rounds, one prefork "
            f"child; measured {m['date_utc']} UTC on {m['cpu_model']} ({m['cpus']} cores, "
            f"shared; load average {m['load_average_at_start'][0]:.1f} at the start, "
            f"{m['load_average_at_end'][0]:.1f} at the end), commit {m['commit']}"
            f"{'' if m['worktree_clean'] else ' with changes'}, Python {m['python']}, "
            f"celery-singleton-lock {m['versions']['celery-singleton-lock']}, Celery "
            f"{m['versions']['celery']}, redis-py {m['versions']['redis']}; lock servers "
            f"{servers['redis']} (scripts, the peers and the floor), {servers['valkey']} "
            f"(native), a Cluster of 3 {servers['cluster']} primaries, Redlock on 3 "
            f"{servers['redlock']} masters. The RTT each relay added, PING through it less "
            f"PING direct (ms): {added}.")


def markdown(results: dict[str, Any], before: Optional[dict[str, Any]] = None) -> str:
    rtts = _rtts(results)
    at = headline(results)
    measured = {r: results["rows"][0]["by_rtt"][r]["rtt_ms"] for r in rtts}
    slope = "slope" in results["rows"][0]
    lines = [
        "### A lock Redis far away", "",
        how(results), "",
        "Round trips to the lock Redis a task waits for, over plain Celery: (task's time "
        "- plain Celery's, same round) / RTT, median of the rounds; a send's own round "
        "trips added where it has any (the peers, `queue_and_run`)"
        + ("; the slope: that difference against the RTT, over every RTT" if slope else "")
        + ".", "",
        "| kind | " + " | ".join(f"RTT {float(r):g} ms ({measured[r]:.2f})" for r in rtts)
        + (" | slope" if slope else "")
        + (f" | before, RTT {float(at):g} ms" if before is not None else "") + " |",
        "|---|" + "---:|" * (len(rtts) + int(slope) + int(before is not None)),
    ]
    for row in results["rows"]:
        cells = [trips_cell(row["by_rtt"][r]) for r in rtts]
        if slope:
            s = row["slope"]
            cells.append(f"{s['round_trips']:.2f}")
        if before is not None:
            cells.append(trips_cell(_at(before, row["kind"], at)))
        lines.append(f"| {row['kind']} | " + " | ".join(cells) + " |")
    lines += [
        "", "Milliseconds per task in the worker (between consecutive finishes), and per "
        "send in the sending loop, medians of the rounds:", "",
        "| kind | " + " | ".join(f"RTT {float(r):g} ms: task, send" for r in rtts)
        + (f" | before, RTT {float(at):g} ms" if before is not None else "") + " |",
        "|---|" + "---:|" * (len(rtts) + int(before is not None)),
    ]
    for row in results["rows"]:
        cells = [f"{row['by_rtt'][r]['task_ms']:.1f}, {row['by_rtt'][r]['send_ms']:.2f}"
                 for r in rtts]
        if before is not None:
            old = _at(before, row["kind"], at)
            cells.append("-" if old is None else f"{old['task_ms']:.1f}, {old['send_ms']:.2f}")
        lines.append(f"| {row['kind']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path, before: Optional[dict[str, Any]] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["kind"] != PLAIN]
    rtts = _rtts(results)
    at = headline(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for row in rows:
        colour = COLOURS.get(row["kind"], "#333333")
        xs = [row["by_rtt"][r]["rtt_ms"] for r in rtts]
        ax1.plot(xs, [row["by_rtt"][r]["round_trips"] for r in rtts], marker="o",
                 color=colour, label=row["kind"])
        old = _row(before, row["kind"])
        if old is not None:
            keys = sorted(old["by_rtt"], key=float)
            ax1.plot([old["by_rtt"][r]["rtt_ms"] for r in keys],
                     [old["by_rtt"][r]["round_trips"] for r in keys], linestyle="--",
                     marker=".", color=colour, alpha=0.5)
    ax1.set_xscale("log")
    ax1.axhline(1.0, color="#d6604d", linestyle=":", linewidth=1)
    ax1.set_xlabel("RTT to the lock Redis, ms")
    ax1.set_ylabel("round trips a task waits for, over plain Celery")
    ax1.set_title("Round trips per task (lower is better)"
                  + ("; dashed: before" if before is not None else ""), fontsize=10)
    top = max(c["round_trips"] for run in (results, before) if run is not None
              for r in run["rows"] for c in r["by_rtt"].values())
    ax1.set_ylim(0, top * 1.45)
    ax1.legend(fontsize=7, ncol=2, loc="upper right")
    names = [textwrap.fill(r["kind"].replace("_", "_ "), 10, break_long_words=False)
             .replace("_ ", "_") for r in rows]
    worker = [r["by_rtt"][at]["worker_round_trips"] for r in rows]
    sender = [r["by_rtt"][at]["sender_round_trips"] for r in rows]
    ax2.bar(names, worker, color=[COLOURS.get(r["kind"], "#333333") for r in rows],
            label="in the worker")
    ax2.bar(names, sender, bottom=worker, color="#fdb863", label="at send")
    if before is not None:
        olds = [_at(before, r["kind"], at) for r in rows]
        ax2.scatter([i for i, o in enumerate(olds) if o is not None],
                    [o["round_trips"] for o in olds if o is not None], marker="_", s=400,
                    color="black", label="before", zorder=3)
    ax2.axhline(1.0, color="#d6604d", linestyle=":", linewidth=1)
    tops = [w + s for w, s in zip(worker, sender)]
    if before is not None:
        tops += [o["round_trips"] for r in rows if (o := _at(before, r["kind"], at))]
    ax2.set_ylim(0, max(tops) * 1.12)
    ax2.set_ylabel("round trips a task waits for")
    ax2.set_title(f"At RTT {float(at):g} ms, worker and sender", fontsize=10)
    ax2.tick_params(axis="x", labelsize=6.5)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capacity_section(before: dict[str, Any], after: Optional[dict[str, Any]]) -> list[str]:
    """``docs/capacity.md``'s section on a lock Redis far away: round trips a
    task waits for and tasks a second one child runs, at the headline RTT and
    the largest one, the earlier run beside the later (its cells left empty
    until it is measured)."""
    at = headline(before)
    far = _rtts(before)[-1]

    def run_line(name: str, results: dict[str, Any]) -> str:
        m = results["machine"]
        return (f"{name}: commit {m['commit']}, {m['date_utc']} UTC, {m['cpu_model']} "
                f"({m['cpus']} cores, shared; load average "
                f"{m['load_average_at_end'][0]:.1f} at the end)")

    def cells(results: Optional[dict[str, Any]], kind: str) -> tuple[str, str, str]:
        near, away = _at(results, kind, at), _at(results, kind, far)
        if near is None or away is None:
            return "", "", ""
        return (trips_cell(near), f"{1000 / near['task_ms']:,.0f}",
                f"{1000 / away['task_ms']:,.0f}")

    plain = _at(before, PLAIN, at)
    scripts = _at(before, "ours, scripts", at)
    assert plain is not None and scripts is not None
    latest_plain = _at(after, PLAIN, at) if after is not None else plain
    latest_scripts = _at(after, "ours, scripts", at) if after is not None else scripts
    assert latest_plain is not None and latest_scripts is not None
    out = [
        "",
        "## A lock Redis far away",
        "",
        "A lock Redis is rarely on the workers' host: a managed service in another zone is "
        "0.5 to 2 ms away, one in another region 20 to 100 ms. There a lock costs a task the "
        "round trips to it that the task waits for, a whole RTT each, whatever the server's "
        "CPU. Measured by a command of its own, `python -m benchmarks.distance` (about 8 "
        "minutes): every lock Redis behind a delay relay of its own, which forwards each "
        "chunk RTT/2 later in each direction (this kernel has no `netem`), the broker "
        "direct; a worker with one prefork child runs 40 queued no-op tasks a batch, plain "
        "Celery, ours on each path, the floor of a lock taken as the task runs (`SET NX PX` "
        "before the body, `DEL` after) and the peers taking turns, 3 rounds. A task's round "
        "trips are its time over plain Celery's in the same round, divided by the RTT; a "
        "send's own are added for the locks taken at send (queue_and_run, the peers). "
        "Every RTT from 1 to 100 ms, and how: [benchmarks](benchmarks.md#a-lock-redis-far-away).",
        "",
        f"| kind | round trips a task waits for at {float(at):g} ms: before | after | "
        f"tasks a second one child runs at {float(at):g} ms: before | after | "
        f"at {float(far):g} ms: before | after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in before["rows"]:
        old, new = cells(before, row["kind"]), cells(after, row["kind"])
        out.append(f"| {row['kind']} | {old[0]} | {new[0]} | {old[1]} | {new[1]} | {old[2]} "
                   f"| {new[2]} |")
    out += [
        "",
        run_line("Before", before) + "; " + (run_line("after", after) if after is not None
                                               else "after: not measured yet") + ".",
        "",
        "A worker child runs at most 1 / (t + n x RTT) tasks a second, t what the task "
        "takes with the lock Redis next door and n the round trips above: with the lock "
        f"Redis {float(at):g} ms away, a no-op task under ours by script ran "
        f"{1000 / latest_scripts['task_ms']:,.0f} a second per child "
        f"({'after' if after is not None else 'before'}), plain Celery "
        f"{1000 / latest_plain['task_ms']:,.0f}. Those waits use no CPU: a far lock Redis "
        "calls for more worker processes or threads, not more cores. A lock taken at send "
        "(`queue_and_run`, the peers) makes the sender wait one round trip per send too.",
    ]
    return out
