"""The plots as PNG files, one or two a section, drawn from ``results.json`` alone."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from .harness import CPU_ROLES, FLOOR
from .real import REAL_CONFIGS, REAL_KINDS, REAL_POOLS


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    colours = {"plain Celery": "#9e9e9e", "celery-singleton-lock": "#1b7837",
               "celery-singleton": "#c2a5cf", "celery-once": "#762a83",
               FLOOR: "#4393c3"}

    if "throughput" in results:
        rows = results["throughput"]["rows"]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
        names = [textwrap.fill(r["config"], 14) for r in rows]
        ax1.bar(names, [r["tasks_per_s"] for r in rows], color=[colours[r["config"]] for r in rows])
        for i, r in enumerate(rows):
            ax1.text(i, r["tasks_per_s"], f"{r['time_ratio']:.2f}x time", ha="center", va="bottom")
        ax1.set_ylabel("tasks per second (higher is better)")
        ax1.set_title("Throughput, trivial task, prefork worker")
        ax1.tick_params(axis="x", labelsize=8)
        commands = sorted({c for r in rows for c in r["round_trips_per_task"]})
        bottom = [0.0] * len(rows)
        palette = plt.get_cmap("tab10")
        for j, cmd in enumerate(commands):
            vals = [r["round_trips_per_task"].get(cmd, 0.0) for r in rows]
            ax2.bar(names, vals, bottom=bottom, label=cmd.upper(), color=palette(j))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_ylabel("round trips to the lock Redis per task")
        ax2.set_title("Redis cost per task (lower is better)")
        ax2.legend(fontsize=8)
        ax2.tick_params(axis="x", labelsize=8)
        save(fig, "throughput")

        if all("cpu_us_per_task" in r for r in rows):
            fig, ax = plt.subplots(figsize=(8, 4.2))
            bottom = [0.0] * len(rows)
            for j, role in enumerate(CPU_ROLES):
                vals = [r["cpu_us_per_task"][role] for r in rows]
                ax.bar(names, vals, bottom=bottom, label=role, color=palette(j))
                bottom = [b + v for b, v in zip(bottom, vals)]
            for i, total in enumerate(bottom):
                ax.text(i, total, f"{total:.0f} µs", ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("CPU per task, µs (lower is better)")
            ax.set_title("Where the time goes: CPU per task by process")
            ax.legend(fontsize=8, loc="lower right")
            ax.tick_params(axis="x", labelsize=8)
            save(fig, "cpu")

    if "heartbeat" in results:
        hb = results["heartbeat"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["locks"] for r in hb]
        ax.plot(xs, [r["renew_ms_median"] for r in hb], marker="o", color=colours[
            "celery-singleton-lock"])
        for r in hb:
            ax.annotate(f"{r['commands_per_renewal']:g} call", (r["locks"], r["renew_ms_median"]),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(1000, color="#d6604d", linestyle="--", linewidth=1)
        ax.text(xs[0], 1000, " 1 second", color="#d6604d", va="bottom", fontsize=8)
        ax.set_xlabel("locks held by one worker process")
        ax.set_ylabel("one renewal of all of them (ms)")
        ax.set_title("Heartbeat: one Redis call per interval")
        save(fig, "heartbeat")

    if "latency" in results:
        lat = results["latency"]
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = ["acquire p50", "acquire p99", "release p50", "release p99"]
        width = 0.38
        for j, (name, ops) in enumerate(lat.items()):
            vals = [ops["acquire"]["p50_us"], ops["acquire"]["p99_us"],
                    ops["release"]["p50_us"], ops["release"]["p99_us"]]
            ax.bar([i + (j - 0.5) * width for i in range(4)], vals, width, label=name,
                   color=colours.get(name, "#4393c3"))
        ax.set_xticks(range(4), labels)
        ax.set_ylabel("microseconds (lower is better)")
        ax.set_title("Lock engine alone vs redis-py Lock, loopback")
        ax.legend()
        save(fig, "latency")

    if "storm" in results:
        s = results["storm"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(["skipped duplicates", "plain Celery tasks", "plain + one GET\n(a skip's floor)"],
               [s["skip_tasks_per_s"], s["plain_tasks_per_s"], s["one_trip_tasks_per_s"]],
               color=[colours["celery-singleton-lock"], colours["plain Celery"],
                      colours[FLOOR]])
        ax.set_ylabel("per second (higher is better)")
        ax.set_title(f"Duplicate storm: {s['deliveries']} deliveries, {s['keys']} keys; "
                     f"overlaps: {s['overlapping_executions']}", fontsize=10)
        save(fig, "storm")
    if "real" in results:
        save(_plot_real(plt, results["real"]), "real")
    if "capacity" in results:
        save(_plot_capacity(plt, results["capacity"]), "capacity")
    return written


def _plot_real(plt: Any, real: dict[str, Any]) -> Any:
    """Time against plain Celery per task and pool: median and rounds' range."""
    groups = [(kind, pool) for kind, _, _ in REAL_KINDS for pool in REAL_POOLS]
    rows = {(r["task"], r["pool"], r["config"]): r for r in real["rows"]}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for j, (label, colour) in enumerate(((REAL_CONFIGS[1][0], "#1b7837"),
                                         (FLOOR, "#4393c3"))):
        picked = [rows[(kind, pool, label)] for kind, pool in groups]
        mids = [r["time_ratio"] for r in picked]
        low = [m - min(r["time_ratios"]) for m, r in zip(mids, picked)]
        high = [max(r["time_ratios"]) - m for m, r in zip(mids, picked)]
        ax.bar([i + (j - 0.5) * width for i in range(len(groups))], mids, width,
               yerr=[low, high], capsize=3, label=label, color=colour)
    ax.axhline(1.0, color="#9e9e9e", linewidth=1)
    ax.axhline(1.02, color="#d6604d", linestyle="--", linewidth=1)
    ax.text(-0.5, 1.02, " 1.02x", color="#d6604d", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{kind}\n{pool}" for kind, pool in groups])
    ax.set_ylabel("time vs plain Celery, paired by round")
    ax.set_title("Tasks that do work: median and rounds' range (lower is better)")
    ax.legend(fontsize=8)
    return fig


def _plot_capacity(plt: Any, cap: dict[str, Any]) -> Any:
    rows = cap["rows"]
    names = [textwrap.fill(r["lock"], 16) for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["ops_per_s"] for r in rows], 0.4,
            label=f"measured, {cap['client_processes']} client processes", color="#4393c3")
    ax1.bar([i + 0.2 for i in x], [r["ops_per_s_per_redis_core"] for r in rows], 0.4,
            label="one fully busy Redis core, at the measured CPU per operation",
            color="#1b7837")
    for i, r in enumerate(rows):
        ax1.text(i - 0.2, r["ops_per_s"], f"Redis {r['redis_utilisation']:.0%} busy",
                 ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("lock operations per second (acquire or release)")
    ax1.set_title("Capacity of one Redis (higher is better)")
    ax1.legend(fontsize=7, loc="lower right")
    inside = [r["redis_command_us_per_op"] for r in rows]
    around = [r["redis_cpu_us_per_op"] - r["redis_command_us_per_op"] for r in rows]
    ax2.bar(names, inside, label="inside the commands (INFO commandstats)", color="#762a83")
    ax2.bar(names, around, bottom=inside, label="the rest: sockets, event loop (/proc)",
            color="#c2a5cf")
    ax2.set_ylabel("Redis CPU µs per lock operation")
    ax2.set_title("Redis CPU per operation (lower is better)")
    ax2.tick_params(axis="x", labelsize=8)
    ax2.legend(fontsize=7)
    return fig
