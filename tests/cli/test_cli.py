"""`celery -A app singleton ...` run as users run it, against a real Redis holding
real locks: one held by a running task, one taken when a task was sent, one done
window, and stale ones whose holder process is dead."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import pytest
import redis
from celery import Celery

from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
from tests.support import (
    ROOT,
    NotRedis,
    RedisServer,
    Worker,
    _Proxy,
    dead_port,
    discard,
    held_on_another_host,
    marker,
    owner_record,
    wait_for,
)
from tests.workerapp import make_app

#: an argument value that must never be printed by any command
SECRET = f"4111-1111-1111-{uuid.uuid4().hex[:8]}"

STALE_HOLDER = """
import os, sys
from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.keys import LockKeys
url, digest, name, task_id = sys.argv[1:5]
engine = connect(SingletonConfig.defaults(url))
reply = engine.acquire(LockKeys("singleton:", digest),
                       Request(task_id, task_id + "x", Lease(120.0), "gone@host", task_name=name))
print(os.getpid(), flush=True)
os._exit(0)  # dies holding the lock, as a killed process would
"""


def digest(keys: LockKeys) -> str:
    return keys.base.split("{", 1)[1].rstrip("}")


def hold_stale(server: RedisServer, keys: LockKeys, name: str) -> tuple[str, int]:
    """A lock taken by a process that then died: (task id, dead pid)."""
    task_id = f"stale-{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, "-c", STALE_HOLDER, server.url(2), digest(keys), name,
                          task_id], cwd=ROOT, capture_output=True, text=True, timeout=30,
                         check=True)
    return task_id, int(out.stdout.strip())


@dataclass
class Scene:
    server: RedisServer
    worker: Worker
    app: Celery
    locks: redis.Redis
    held: LockKeys
    held_id: str
    held_pid: int
    held_token: int
    queued: LockKeys
    queued_id: str
    done: LockKeys
    done_id: str
    stale: LockKeys
    stale_id: str
    stale_pid: int


def run_cli(env: dict[str, str], *args: str, app: str = "tests.workerapp:app",
            command: str = "singleton") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "celery", "-A", app, command, *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    server = RedisServer().start()
    queue = f"q-{uuid.uuid4().hex[:8]}"
    worker = Worker(server.url(), queue).start()
    try:
        app = make_app(server.url(), queue)
        events = server.client(3)
        hold = app.tasks["t.hold"]
        # held for the whole module (killed with the worker at its end): a
        # 60 s hold ended before the module did on a loaded machine
        held = hold.delay(SECRET, 3600.0, "held")
        start = wait_for(lambda: [json.loads(e) for e in events.lrange("events", 0, -1)
                                  if json.loads(e)["tag"] == "held"], 20, what="held start")[0]
        queued = app.tasks["t.queue"].apply_async(kwargs={"key": f"q-{SECRET}"}, countdown=60)
        done = app.tasks["t.run_done_long"].delay(f"d-{SECRET}", 0.0, "done")
        done.get(timeout=20)
        stale = hold.singleton_keys(f"s-{SECRET}")
        stale_id, stale_pid = hold_stale(server, stale, "t.hold")
        scene = Scene(
            server, worker, app, server.client(2),
            hold.singleton_keys(SECRET), held.id, start["pid"], start["token"],
            app.tasks["t.queue"].singleton_keys(f"q-{SECRET}"), queued.id,
            app.tasks["t.run_done_long"].singleton_keys(f"d-{SECRET}"), done.id,
            stale, stale_id, stale_pid)
        # results hold a subscription to the result backend: gone before the server
        del held, queued, done
        yield scene
    finally:
        worker.kill_all()  # its held task would hold a warm shutdown for a minute
        worker.stop()
        server.cleanup()


def cli(scene: Scene, *args: str) -> subprocess.CompletedProcess[str]:
    out = run_cli(scene.worker.env, *args)
    assert SECRET not in out.stdout + out.stderr, "an argument value was printed"
    return out


def rows(out: subprocess.CompletedProcess[str]) -> dict[tuple[str, str], dict[str, Any]]:
    assert out.returncode == 0, out.stderr
    return {(r["key"], r["state"]): r for r in json.loads(out.stdout)["locks"]}


def test_list_json_shows_running_queued_done_and_stale_keys_with_their_holders(scene):
    """Each kind of key is one row: the running lock names the task, the worker child's
    pid and token, alive; the stale one is dead; queued and done name their task and
    its id (the markers carry the task's name)."""
    found = rows(cli(scene, "list", "--json"))
    held = found[(scene.held.base, "run")]
    assert (held["task"], held["holder"], held["pid"], held["live"]) == (
        "t.hold", scene.held_id, scene.held_pid, "alive")
    assert held["token"] == scene.held_token and held["masters"] is None
    assert 0 < held["ttl"] <= 2.0 and held["age"] >= 0
    queued, done = found[(scene.queued.base, "queued")], found[(scene.done.base, "done")]
    assert (queued["task"], queued["holder"]) == ("t.queue", scene.queued_id)
    assert queued["token"] is None and queued["masters"] is None
    assert (done["task"], done["holder"]) == ("t.run_done_long", scene.done_id)
    stale = found[(scene.stale.base, "run")]
    assert (stale["holder"], stale["pid"], stale["live"]) == (
        scene.stale_id, scene.stale_pid, "dead")


def test_list_json_fields_are_the_ones_the_docs_table_gives(scene):
    """docs/operating.md lists every field of a `list --json` row with its type."""
    page = (ROOT / "docs" / "operating.md").read_text()
    section = page[page.index("`--json` prints `{\"redis\": <masked URL>"):]
    section = section[:section.index("\n\n", section.index("| field |"))]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    for row in json.loads(cli(scene, "list", "--json").stdout)["locks"]:
        assert sorted(row) == sorted(documented)
        assert row["token"] is None or isinstance(row["token"], int)


def test_list_table_is_for_people_and_exits_0(scene):
    out = cli(scene, "list")
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.split() == ["KEY", "STATE", "TASK", "HOLDER", "HOST", "PID", "TOKEN", "TTL",
                              "AGE", "LIVE"]
    assert any(scene.held.base in line and "alive" in line for line in lines)
    assert any(scene.stale.base in line and "dead" in line for line in lines)


def test_list_filters_by_task_and_state(scene):
    """--task keeps the task's rows, --state one state; the filters combine."""
    by_task = rows(cli(scene, "list", "--json", "--task", "t.hold"))
    assert {k[0] for k in by_task} == {scene.held.base, scene.stale.base}
    assert set(rows(cli(scene, "list", "--json", "--state", "done"))) == {
        (scene.done.base, "done")}
    assert set(rows(cli(scene, "list", "--json", "--state", "queued"))) == {
        (scene.queued.base, "queued")}
    assert rows(cli(scene, "list", "--json", "--task", "t.hold", "--state", "queued")) == {}
    assert set(rows(cli(scene, "list", "--json", "--task", "t.queue"))) >= {
        (scene.queued.base, "queued")}


def test_key_maps_a_call_to_its_key_and_holder_in_any_call_form(scene):
    """Positional and keyword forms of one call give the key the worker locked, and
    its holder; the argument itself is hashed, never printed."""
    by_args = cli(scene, "key", "t.hold", "--args", json.dumps([SECRET]), "--json")
    by_kwargs = cli(scene, "key", "t.hold", "--kwargs", json.dumps({"key": SECRET}), "--json")
    assert by_args.returncode == by_kwargs.returncode == 0, by_args.stderr
    first, second = json.loads(by_args.stdout), json.loads(by_kwargs.stdout)
    assert first["key"] == second["key"] == scene.held.base
    assert first["held"] is True
    assert first["locks"][0]["holder"] == scene.held_id
    table = cli(scene, "key", "t.hold", "--args", json.dumps([SECRET]))
    assert scene.held.base in table.stdout and scene.held_id in table.stdout
    free = json.loads(cli(scene, "key", "t.hold", "--args", '["nobody"]', "--json").stdout)
    assert free["held"] is False and free["locks"] == []


def test_key_usage_errors_exit_2_without_echoing_the_value(scene):
    unknown = cli(scene, "key", "t.nope", "--args", "[]")
    assert unknown.returncode == 2 and "t.nope" in unknown.stderr
    not_singleton = cli(scene, "key", "t.plain", "--args", "[]")
    assert not_singleton.returncode == 2
    bad = cli(scene, "key", "t.hold", "--args", "{" + SECRET)  # cli() asserts it is not echoed
    assert bad.returncode == 2 and "--args" in bad.stderr


def test_a_misspelt_task_name_gets_the_closest_singleton_task_names(scene):
    """`key`, `list --task` and `purge --task` with a typo of a task name exit 2
    naming the singleton tasks it is close to, as a misspelt setting does."""
    key = cli(scene, "key", "t.hlod", "--args", '["x"]')
    assert key.returncode == 2
    assert key.stderr.startswith("no singleton task named 't.hlod' in this app; did you mean "
                                 "t.hold"), key.stderr
    for command in ("list", "purge"):
        out = cli(scene, command, "--task", "t.fencd")
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.strip() == ("no keys of task 't.fencd', and no singleton task of "
                                      "that name in this app; did you mean t.fenced?")
    nothing_close = cli(scene, "list", "--task", "zzz.qqq")
    assert nothing_close.returncode == 2 and "did you mean" not in nothing_close.stderr
    # a singleton task of the app with no such keys now is no error
    assert rows(cli(scene, "list", "--json", "--task", "t.throttle", "--state", "replaced")) == {}


def test_without_an_app_the_commands_say_to_pass_it():
    """`celery singleton list` with no -A (and no CELERY_APP): Celery's default
    app has none of our settings; the command says to pass -A, not that the
    lock Redis URL is unset."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    for command in (["list"], ["doctor"], ["key", "tasks.charge", "--args", "[42]"]):
        out = subprocess.run([sys.executable, "-m", "celery", "singleton", *command],
                             env=env, cwd=ROOT / "docs", capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert out.stderr.strip() == ("no app given: pass -A with your Celery app's module, "
                                      "as for the worker (celery -A proj singleton ...)")


def test_release_refuses_a_live_holder_without_force_then_force_frees_it(scene):
    """A lock held by a running task stays held without --force (exit 1, nothing
    changed); --force releases it (exit 0) and the running task sees its lock lost."""
    key = uuid.uuid4().hex
    hold = scene.app.tasks["t.hold"]
    result = hold.delay(key, 120.0, f"force-{key}")  # ended below, once seen lost
    keys = hold.singleton_keys(key)
    wait_for(lambda: scene.locks.exists(keys.lock), 20, what="lock taken")
    refused = cli(scene, "release", keys.base, "--json")
    assert refused.returncode == 1
    answer = json.loads(refused.stdout)
    assert (answer["action"], answer["holder"], answer["live"]) == ("refused", result.id,
                                                                     "alive")
    # the holder named as its record names it: the pool child running it
    record = owner_record(scene.locks, keys.lock)
    assert (answer["pid"], answer["token"]) == (int(record["pid"]), int(record["token"]))
    assert answer["pid"] in scene.worker.children(), answer
    assert scene.locks.exists(keys.lock)
    forced = cli(scene, "release", keys.lock, "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"released {keys.base}" in forced.stdout and result.id in forced.stdout
    assert not scene.locks.exists(keys.lock)
    wait_for(lambda: f"of t.hold[{result.id}]" in scene.worker.logs(), 20,
             what="the worker to log the lock lost")
    scene.server.client(3).set(f"finish:{key}", 1)
    assert result.get(timeout=20)["lost"] is True


def test_release_of_a_slots_lock_key_frees_that_slot_only(scene):
    """docs/limit.md: ``release '<key>:lock:<n>'`` frees slot n of a
    ``singleton_limit`` key, naming its holder; the other slot stays held."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect

    keys = scene.app.tasks["t.hold"].singleton_keys(f"slots-{SECRET}")
    engine = connect(SingletonConfig.defaults(scene.server.url(2)))
    holders = {}
    for n in (1, 2):
        task_id = f"slot{n}-{uuid.uuid4().hex[:8]}"
        got = engine.acquire(keys, Request(task_id=task_id, exec_id=f"{task_id}-exec",
                                           lease=Lease.of_ms(120_000), hostname="w1@host",
                                           retries=0, task_name="t.hold", slots=2))
        assert got.slot == n, got
        holders[n] = task_id
    out = cli(scene, "release", keys.slot(2).lock, "--force", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    answer = json.loads(out.stdout)
    assert (answer["action"], answer["holder"]) == ("released", holders[2])
    assert not scene.locks.exists(keys.slot(2).lock)
    assert owner_record(scene.locks, keys.lock)["task"] == holders[1]


def test_list_shows_each_held_slot_with_its_own_holder_and_ttl(scene):
    """docs/limit.md: under ``singleton_limit`` each slot is a lock of its own;
    `list` shows each held slot with its holder and the TTL of that slot's key
    (three slots, leases of 600, 300 and 100 s: each TTL within its own)."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect

    keys = scene.app.tasks["t.hold"].singleton_keys(f"three-{SECRET}")
    engine = connect(SingletonConfig.defaults(scene.server.url(2)))
    leases = {1: 600, 2: 300, 3: 100}
    holders = {}
    try:
        for n, lease in leases.items():
            task_id = f"slot{n}-{uuid.uuid4().hex[:8]}"
            got = engine.acquire(keys, Request(task_id=task_id, exec_id=f"{task_id}-exec",
                                               lease=Lease.of_ms(lease * 1000),
                                               hostname="w1@host", retries=0,
                                               task_name="t.hold", slots=3))
            assert got.slot == n, got
            holders[n] = task_id
        shown = [r for r in json.loads(cli(scene, "list", "--json").stdout)["locks"]
                 if r["key"] == keys.base]
        by_holder = {r["holder"]: r for r in shown}
        assert sorted(by_holder) == sorted(holders.values()), shown
        below = {1: 300, 2: 100, 3: 0}
        for n, task_id in holders.items():
            assert below[n] < by_holder[task_id]["ttl"] <= leases[n], (n, shown)
    finally:
        for n, task_id in holders.items():
            engine.release(keys.slot(n), f"{task_id}-exec", task_id, finished=False)
        engine.close()


def test_release_frees_a_dead_holders_lock_without_force(scene):
    """A holder whose process is gone from this host needs no --force."""
    keys = scene.app.tasks["t.hold"].singleton_keys(f"dead-{SECRET}")
    task_id, _ = hold_stale(scene.server, keys, "t.hold")
    out = cli(scene, "release", keys.base, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    answer = json.loads(out.stdout)
    assert (answer["action"], answer["holder"], answer["live"]) == ("released", task_id, "dead")
    assert not scene.locks.exists(keys.lock)


def hold_on_another_host(scene: Scene, keys: LockKeys, name: str) -> str:
    """A lock a worker on a second machine holds (its host key, its host name,
    a pid that names no process here): the holder's task id."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect

    task_id = f"remote-{uuid.uuid4().hex[:8]}"
    engine = connect(SingletonConfig.defaults(scene.server.url(2)))
    engine.acquire(keys, Request(task_id=task_id, exec_id=f"{task_id}-exec",
                                 lease=Lease.of_ms(120_000), hostname="w1@other-machine",
                                 retries=0, task_name=name))
    held_on_another_host(scene.locks, keys.lock)
    return task_id


def test_release_and_purge_keep_a_lock_held_on_another_host_without_force(scene):
    """Nothing here can tell whether a process on another machine lives: its
    lock is "unknown", and release (exit 1, "runs on another host") and purge
    (kept, exit 1) leave it without --force, however dead its pid looks here;
    release --force frees it."""
    fenced = scene.app.tasks["t.fenced"]
    keys = fenced.singleton_keys(f"remote-{SECRET}")
    task_id = hold_on_another_host(scene, keys, "t.fenced")
    record = scene.locks.get(keys.lock)
    listed = rows(cli(scene, "list", "--task", "t.fenced", "--json"))[(keys.base, "run")]
    assert (listed["holder"], listed["host"], listed["live"]) == (
        task_id, "w1@other-machine", "unknown")

    refused = cli(scene, "release", keys.base, "--json")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    answer = json.loads(refused.stdout)
    assert (answer["action"], answer["holder"], answer["live"]) == ("refused", task_id,
                                                                     "unknown")
    assert "runs on another host" in cli(scene, "release", keys.base).stdout
    dry = json.loads(cli(scene, "purge", "--task", "t.fenced", "--json").stdout)
    assert (keys.base, "would keep: may run") in {(e["key"], e["action"]) for e in dry["keys"]}
    kept = cli(scene, "purge", "--task", "t.fenced", "--yes", "--json")
    assert kept.returncode == 1, kept.stdout + kept.stderr
    assert (keys.base, "unknown", "kept: may run") in {
        (e["key"], e["live"], e["action"]) for e in json.loads(kept.stdout)["keys"]}
    assert scene.locks.get(keys.lock) == record, "the other host's lock is untouched"

    forced = cli(scene, "release", keys.base, "--force", "--json")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert json.loads(forced.stdout)["action"] == "released"
    assert not scene.locks.exists(keys.lock)


def test_release_of_a_free_key_or_a_bad_key_says_so(scene):
    free = cli(scene, "release", "0" * 32, "--json")
    assert free.returncode == 1 and json.loads(free.stdout)["action"] == "not-held"
    assert cli(scene, "release", "not-a-key").returncode == 2


def test_release_of_a_send_time_marker_needs_force(scene):
    """A key taken when a task was sent belongs to a task waiting in the queue."""
    key = f"m-{uuid.uuid4().hex}"
    sent = scene.app.tasks["t.queue"].apply_async(kwargs={"key": key}, countdown=60)
    keys = scene.app.tasks["t.queue"].singleton_keys(key)
    assert marker(scene.locks, keys.queued) == ("t.queue", sent.id)
    assert cli(scene, "release", keys.base).returncode == 1
    assert marker(scene.locks, keys.queued) == ("t.queue", sent.id)
    out = cli(scene, "release", keys.base, "--force")
    assert out.returncode == 0 and sent.id in out.stdout
    assert scene.locks.get(keys.queued) is None
    sent.revoke()


def test_purge_is_a_dry_run_unless_yes_and_keeps_the_fencing_counters(scene):
    fenced = scene.app.tasks["t.fenced"]
    keys = [fenced.singleton_keys(f"p{i}-{SECRET}") for i in range(2)]
    for k in keys:
        hold_stale(scene.server, k, "t.fenced")
    dry = cli(scene, "purge", "--task", "t.fenced", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] is True
    assert {(e["key"], e["action"]) for e in plan["keys"]} == {
        (k.base, "would delete") for k in keys}
    assert all(scene.locks.exists(k.lock) for k in keys)
    table = cli(scene, "purge", "--task", "t.fenced")
    assert "dry run: nothing deleted" in table.stdout
    done = cli(scene, "purge", "--task", "t.fenced", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    assert {e["action"] for e in json.loads(done.stdout)["keys"]} == {"deleted"}
    assert not any(scene.locks.exists(k.lock) for k in keys)
    assert all(scene.locks.exists(k.fence) for k in keys)
    assert scene.locks.exists(scene.held.lock), "other tasks' locks are untouched"


def test_purge_by_task_frees_its_send_time_markers_and_done_windows(scene):
    """With no lock held, a task's keys are its markers: `purge --task` finds
    them by the name they carry and frees them on --yes."""
    done = scene.app.tasks["t.run_done_long"]
    finished = done.delay(f"pd-{SECRET}", 0.0, "purge-done")
    finished.get(timeout=20)
    done_keys = done.singleton_keys(f"pd-{SECRET}")
    assert marker(scene.locks, done_keys.done) == ("t.run_done_long", finished.id)
    out = cli(scene, "purge", "--task", "t.run_done_long", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert (done_keys.base, "done", "deleted") in {
        (e["key"], e["state"], e["action"]) for e in json.loads(out.stdout)["keys"]}
    assert not scene.locks.exists(done_keys.done)

    key = f"pq-{uuid.uuid4().hex}"
    sent = scene.app.tasks["t.queue"].apply_async(kwargs={"key": key}, countdown=60)
    queued_keys = scene.app.tasks["t.queue"].singleton_keys(key)
    out = cli(scene, "purge", "--task", "t.queue", "--yes", "--force", "--json")
    assert out.returncode == 0, out.stderr
    assert (queued_keys.base, "queued", "deleted") in {
        (e["key"], e["state"], e["action"]) for e in json.loads(out.stdout)["keys"]}
    assert not scene.locks.exists(queued_keys.queued)
    sent.revoke()


def test_purge_frees_a_throttle_window_and_says_so(scene):
    """An open throttle window is a key of its task: `purge --task` lists it as
    throttled and would delete it; with --yes it reports it deleted, the window
    is gone, and the next call runs at once (a 120 s window: open through every
    command, however slow the machine)."""
    t = scene.app.tasks["t.throttle_long"]
    key = f"pt-{uuid.uuid4().hex}"
    first = t.delay(key, 0.0, "throttle-first")
    first.get(timeout=20)
    keys = t.singleton_keys(key)
    assert scene.locks.exists(keys.throttle)
    dry = json.loads(cli(scene, "purge", "--task", "t.throttle_long", "--json").stdout)
    assert (keys.base, "throttled", "would delete") in {
        (e["key"], e["state"], e["action"]) for e in dry["keys"]}
    out = cli(scene, "purge", "--task", "t.throttle_long", "--yes", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (keys.base, "throttled", first.id, "deleted") in {
        (e["key"], e["state"], e["holder"], e["action"]) for e in json.loads(out.stdout)["keys"]}
    assert not scene.locks.exists(keys.throttle), "the window is gone"
    assert rows(cli(scene, "list", "--json", "--task", "t.throttle_long",
                    "--state", "throttled")) == {}
    table = cli(scene, "purge", "--task", "t.throttle_long", "--yes")
    assert "no keys of task 't.throttle_long'" in table.stdout, table.stdout
    assert t.delay(key, 0.0, "after-purge").get(timeout=20)["tag"] == "after-purge"


def test_purge_keeps_a_queued_tasks_send_time_key_without_force_as_release_does(scene):
    """A key taken when a task was sent belongs to a task waiting in the queue:
    `release` frees it only with --force, and `purge --yes` keeps it the same way
    (exit 1, saying what to pass); with --force both free it."""
    t = scene.app.tasks["t.queue"]
    key = f"pk-{uuid.uuid4().hex}"
    sent = t.apply_async(kwargs={"key": key}, countdown=60)
    keys = t.singleton_keys(key)
    assert marker(scene.locks, keys.queued) == ("t.queue", sent.id)
    assert cli(scene, "release", keys.base).returncode == 1
    dry = json.loads(cli(scene, "purge", "--task", "t.queue", "--json").stdout)
    assert {(e["key"], e["action"]) for e in dry["keys"]} >= {(keys.base, "would keep: queued")}
    kept = cli(scene, "purge", "--task", "t.queue", "--yes")
    assert kept.returncode == 1, kept.stdout + kept.stderr
    assert "taken when their task was sent, which waits in the queue" in kept.stdout
    assert keys.base in kept.stdout and "--force" in kept.stdout
    assert marker(scene.locks, keys.queued) == ("t.queue", sent.id)
    forced = cli(scene, "purge", "--task", "t.queue", "--yes", "--force", "--json")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert (keys.base, "deleted") in {(e["key"], e["action"])
                                      for e in json.loads(forced.stdout)["keys"]}
    assert scene.locks.get(keys.queued) is None
    sent.revoke()


def test_purge_keeps_a_live_holders_lock_without_force_as_release_does(scene):
    """A running task's lock stays without --force (exit 1, named with what to
    pass) while the stale lock of a dead process goes; --force frees both."""
    fenced = scene.app.tasks["t.fenced"]
    key = f"alive-{uuid.uuid4().hex}"
    # runs until revoked: three CLI runs take half a minute on a loaded machine,
    # and a task that ended meanwhile would leave no live lock to keep
    running = fenced.delay(key, 600.0, f"purge-{key}")
    try:
        alive = fenced.singleton_keys(key)
        wait_for(lambda: scene.locks.exists(alive.lock), 20, what="lock taken")
        stale = fenced.singleton_keys(f"ps-{SECRET}")
        hold_stale(scene.server, stale, "t.fenced")
        dry = json.loads(cli(scene, "purge", "--task", "t.fenced", "--json").stdout)
        assert {(e["key"], e["action"]) for e in dry["keys"]} == {
            (alive.base, "would keep: may run"), (stale.base, "would delete")}

        kept = cli(scene, "purge", "--task", "t.fenced", "--yes")
        assert kept.returncode == 1, kept.stdout + kept.stderr
        assert "kept 1 lock(s) whose holder may still run" in kept.stdout
        [kept_line] = [line for line in kept.stdout.splitlines() if line.startswith("kept 1 ")]
        assert alive.base in kept_line and "--force" in kept_line
        assert kept.stdout.splitlines()[-1] == "deleted 1 key(s)"
        assert scene.locks.exists(alive.lock) and not scene.locks.exists(stale.lock)

        hold_stale(scene.server, stale, "t.fenced")
        forced = cli(scene, "purge", "--task", "t.fenced", "--yes", "--force", "--json")
        assert forced.returncode == 0, forced.stdout + forced.stderr
        assert {(e["key"], e["live"], e["action"])
                for e in json.loads(forced.stdout)["keys"]} == {
            (alive.base, "alive", "deleted"), (stale.base, "dead", "deleted")}
        assert not scene.locks.exists(alive.lock) and not scene.locks.exists(stale.lock)
    finally:
        running.revoke(terminate=True)


def test_purge_dry_run_and_yes_agree_on_what_goes_and_on_the_exit_code(scene):
    """With only a lock whose holder may still run, purge may delete nothing
    without --force: the dry run and --yes both say so, keep it and exit 1 (a
    dry run exits as --yes would). With a stale lock beside it, the dry run's
    "would delete" keys are the keys --yes deletes, and both exit 1 again."""
    name = "t.hold_short"
    task = scene.app.tasks[name]
    live = task.singleton_keys(f"only-{SECRET}")
    task_id = hold_on_another_host(scene, live, name)
    record = scene.locks.get(live.lock)
    dry, yes = cli(scene, "purge", "--task", name), cli(scene, "purge", "--task", name, "--yes")
    assert (dry.returncode, yes.returncode) == (1, 1), dry.stdout + yes.stdout
    assert dry.stdout.splitlines()[-1] == "dry run: nothing to delete", dry.stdout
    assert yes.stdout.splitlines()[-1] == "nothing to delete", yes.stdout
    assert "would keep 1 lock(s)" in dry.stdout and "kept 1 lock(s)" in yes.stdout
    assert scene.locks.get(live.lock) == record

    stale = task.singleton_keys(f"gone-{SECRET}")
    hold_stale(scene.server, stale, name)
    dry = cli(scene, "purge", "--task", name, "--json")
    plan = {(e["key"], e["action"]) for e in json.loads(dry.stdout)["keys"]}
    assert plan == {(live.base, "would keep: may run"), (stale.base, "would delete")}
    assert "pass --yes to delete these 1 key(s)" in cli(scene, "purge", "--task", name).stdout
    yes = cli(scene, "purge", "--task", name, "--yes", "--json")
    done = {(e["key"], e["action"]) for e in json.loads(yes.stdout)["keys"]}
    assert done == {(live.base, "kept: may run"), (stale.base, "deleted")}
    assert (dry.returncode, yes.returncode) == (1, 1), dry.stdout + yes.stdout
    assert not scene.locks.exists(stale.lock) and scene.locks.get(live.lock) == record
    assert "nothing to delete" in cli(scene, "purge", "--task", name).stdout
    assert cli(scene, "release", live.base, "--force").returncode == 0
    assert task_id and not scene.locks.exists(live.lock)


def test_doctor_prints_findings_with_what_to_do_and_exits_1_on_warnings(scene):
    """The test server keeps nothing on disk: a persistence warning, exit 1."""
    out = cli(scene, "doctor", "--json")
    assert out.returncode == 1, out.stderr
    findings = {f["code"]: f for f in json.loads(out.stdout)["findings"]}
    assert findings["scripts"]["level"] == "ok"
    assert findings["persistence"]["level"] == "warning"
    table = cli(scene, "doctor")
    assert "WARNING  persistence" in table.stdout and "-> " in table.stdout


def test_doctor_prints_the_checks_the_docs_show(scene):
    """The doctor example in docs/operating.md shows one line per check, in the
    order doctor prints them, and the scripts line says how many it ran."""
    page = (ROOT / "docs" / "operating.md").read_text()
    example = page[page.index("$ celery -A proj singleton doctor\n"):]
    example = example[:example.index("```")]
    documented = re.findall(r"^(?:OK|WARNING|ERROR) +(\S+) +(.*)$", example, re.M)
    printed = json.loads(cli(scene, "doctor", "--json").stdout)["findings"]
    assert [code for code, _ in documented] == [f["code"] for f in printed]
    scripts = next(f["message"] for f in printed if f["code"] == "scripts")
    assert dict(documented)["scripts"].split(" as user")[0] == scripts.split(" as user")[0]


def env_with_lock_url(scene: Scene, url: str) -> dict[str, str]:
    env = dict(scene.worker.env)
    env["SLT_LOCK_URL"] = url
    return env


def test_list_on_redlock_says_which_master_did_not_answer(scene):
    """With one of three Redlock masters refusing connections, `list` still
    answers (two are a majority) and says on stderr which master did not
    answer, and why; with two of three down it exits 2 saying so."""
    masters = [RedisServer().start() for _ in range(2)]
    try:
        dead = dead_port()
        ports = [masters[0].port, masters[1].port, dead]
        env = env_with_lock_url(
            scene, "redlock://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/2")
        listing = run_cli(env, "list", "--json")
        assert listing.returncode == 0, listing.stderr
        assert json.loads(listing.stdout)["locks"] == []
        assert f"masters not answering: 127.0.0.1:{dead} (ConnectionError: " in listing.stderr
        masters[1].stop()
        listing = run_cli(env, "list", "--json")
        assert listing.returncode == 2, listing.stdout + listing.stderr
        assert "only 1 of 3 masters answered" in listing.stderr, listing.stderr
    finally:
        for m in masters:
            m.cleanup()


def test_redis_down_exits_2_and_says_unreachable(scene):
    env = env_with_lock_url(scene, f"redis://127.0.0.1:{dead_port()}/2")
    doctor = run_cli(env, "doctor", "--json")
    assert doctor.returncode == 2
    assert [f["code"] for f in json.loads(doctor.stdout)["findings"]] == ["unreachable"]
    listing = run_cli(env, "list")
    assert listing.returncode == 2 and "unreachable" in listing.stderr
    assert "Traceback" not in listing.stderr


def test_a_lock_url_at_a_server_that_is_not_redis_is_named_without_a_traceback(scene):
    """An HTTP server at the lock URL: doctor reports `not-redis` and exits 2;
    list and key say the same in one line and exit 2, with no traceback."""
    other = NotRedis()
    try:
        env = env_with_lock_url(scene, other.url(2))
        doctor = run_cli(env, "doctor", "--json")
        listing = run_cli(env, "list")
        key = run_cli(env, "key", "t.hold", "--args", '["x"]')
    finally:
        other.close()
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    [finding] = json.loads(doctor.stdout)["findings"]
    assert finding["code"] == "not-redis" and finding["level"] == "error"
    assert 'it said "HTTP/1.1 400 Bad Request"' in finding["message"]
    for out in (listing, key):
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"lock Redis at {other.url(2)} answers, but not as Redis does: it said "
            "\"HTTP/1.1 400 Bad Request\". What to do: point singleton_redis_url at the Redis "
            "host and port (rediss:// if that port speaks TLS); that address serves something "
            "else"], out.stderr
    for out in (doctor, listing, key):
        assert "Traceback" not in out.stderr and "InvalidResponse" not in out.stderr


def test_a_wrong_password_is_named_and_never_printed():
    """doctor reports `auth` and exits 2, as its exit-code table says; so do the
    other commands; the password is masked."""
    server = RedisServer(["--requirepass", "right-pw"]).start()
    try:
        env = Worker(server.url(), "unused").env
        env["SLT_REDIS_URL"] = f"redis://:right-pw@127.0.0.1:{server.port}/0"
        env["SLT_LOCK_URL"] = f"redis://:wrong-pw-123@127.0.0.1:{server.port}/2"
        doctor = run_cli(env, "doctor", "--json")
        assert doctor.returncode == 2
        assert [f["code"] for f in json.loads(doctor.stdout)["findings"]] == ["auth"]
        listing = run_cli(env, "list")
        assert listing.returncode == 2 and "credentials" in listing.stderr
        for out in (doctor, listing):
            assert "wrong-pw-123" not in out.stdout + out.stderr
            assert "right-pw" not in out.stdout + out.stderr
    finally:
        server.cleanup()


def test_doctor_says_whether_a_beat_of_the_app_may_run_what_its_entries_need():
    """An app whose beat_schedule has a buffer_one entry of a SingletonTask, its lock
    user holding the worker's rule only: doctor's `beat` finding is an ERROR naming
    EXISTS and GETDEL and the grant; granted them, it is OK. Without a schedule,
    no `beat` finding."""
    from celery_singleton_lock.checks.doctor import acl_rule

    server = RedisServer().start()
    try:
        server.client().execute_command("ACL", "SETUSER", "locks", "on", ">pw",
                                        *acl_rule("singleton:", 2).split())
        env = Worker(server.url(), "unused").env
        env["SLT_LOCK_URL"] = f"redis://locks:pw@127.0.0.1:{server.port}/2"

        def beat_findings() -> list[dict[str, Any]]:
            out = run_cli(env, "doctor", "--json")
            assert out.returncode in (0, 1), out.stderr
            return [f for f in json.loads(out.stdout)["findings"] if f["code"] == "beat"]

        assert beat_findings() == []
        env["SLT_CONF"] = json.dumps({"beat_schedule": {"nightly": {
            "task": "t.hold", "schedule": 60, "options": {"singleton_overlap": "buffer_one"}}}})
        [refused] = beat_findings()
        assert refused["level"] == "error"
        assert "'locks' may not run exists, getdel" in refused["message"]
        assert "ACL SETUSER locks +exists +getdel" in refused["action"]
        server.client().execute_command("ACL", "SETUSER", "locks", "+exists", "+getdel")
        [granted] = beat_findings()
        assert granted["level"] == "ok" and "buffer_one" in granted["message"]
    finally:
        server.cleanup()


# -- masked secrets in Celery's printed config ------------------------------------

def conf_table(app: Celery) -> dict[str, Any]:
    return dict(app.conf.table())


def test_masking_install_hides_our_url_and_option_passwords_celery_would_print(monkeypatch):
    """Celery alone prints singleton_redis_url with its password; after install()
    the URL and every password in singleton_redis_options are masked."""
    from celery.app import utils

    from celery_singleton_lock.observe import masking

    monkeypatch.setattr(utils, "filter_hidden_settings", utils.filter_hidden_settings)
    app = make_app("redis://127.0.0.1:1/0", lock_url="redis://locks:url-pw@h:6379/2",
                   conf={"singleton_redis_options": {"sentinel_kwargs": {"passwd": "x-pw"},
                                                     "password": "opt-pw"}})
    if not masking.installed():
        assert "url-pw" in str(conf_table(app)), "Celery alone leaks it"
    masking.install()
    table = conf_table(app)
    assert table["singleton_redis_url"] == "redis://locks:********@h:6379/2"
    assert not {"url-pw", "opt-pw", "x-pw"} & set(str(table).split("'"))


@pytest.fixture
def secret_worker() -> Iterator[tuple[Worker, RedisServer]]:
    """A worker whose lock Redis needs a password, given in the URL and the options."""
    broker = RedisServer().start()
    locks = RedisServer(["--requirepass", "lock-secret-pw"]).start()
    queue = f"q-{uuid.uuid4().hex[:8]}"
    worker = Worker(broker.url(), queue,
                    lock_url=f"redis://:lock-secret-pw@127.0.0.1:{locks.port}/2",
                    conf={"singleton_redis_options": {"password": "lock-secret-pw"}})
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.cliapp:app"
    worker.start()
    try:
        yield worker, locks
    finally:
        discard(worker)
        locks.cleanup()
        broker.cleanup()


def test_inspect_conf_and_report_mask_the_lock_redis_password(secret_worker):
    """`celery inspect conf` (what Flower's config page shows) from a real worker, and
    `celery report`, print the lock URL masked and no password anywhere."""
    worker, locks = secret_worker
    out: Optional[subprocess.CompletedProcess[str]] = None

    def answered() -> bool:
        nonlocal out
        out = run_cli(worker.env, "conf", "--json", "--timeout", "5", command="inspect")
        return out.returncode == 0 and "singleton_redis_url" in out.stdout

    wait_for(answered, 30, interval=0.5, what="inspect conf reply")
    assert out is not None
    replies = json.loads(out.stdout)
    (conf,) = replies.values()
    assert conf["singleton_redis_url"] == f"redis://:********@127.0.0.1:{locks.port}/2"
    assert conf["singleton_redis_options"] == {"password": "********"}
    assert "lock-secret-pw" not in out.stdout
    report = run_cli(worker.env, command="report")
    assert report.returncode == 0, report.stderr
    assert "singleton_redis_url" in report.stdout
    assert "lock-secret-pw" not in report.stdout


class HoldingProxy(_Proxy):
    """A proxy to the lock Redis that stops the command's first write naming
    ``hold_on`` (its release or unqueue: a script call, or a plain delete)
    before it reaches Redis: :attr:`reached` is set, and the write goes on once
    :attr:`go` is. Its read went through already, so between the two the test's
    own client can make the key change hands: the moment a release or purge
    meets a key whose holder changed since it was read."""

    WRITES = (b"\r\nEVALSHA\r\n", b"\r\nEVAL\r\n", b"\r\nDEL\r\n", b"\r\nUNLINK\r\n")

    def __init__(self, target_port: int, hold_on: str) -> None:
        self.hold_on = hold_on.encode()
        self.reached = threading.Event()
        self.go = threading.Event()
        super().__init__(target_port)

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, bool]) -> None:
        seen = b""
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                seen = seen[-4096:] + data  # a call split over two reads is still seen
                if (not self.reached.is_set() and self.hold_on in seen
                        and any(w in seen.upper() for w in self.WRITES)):
                    self.reached.set()
                    self.go.wait(120)
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)


def cli_while_changing_hands(scene: Scene, hold_on: str, change: Callable[[], None],
                             *args: str) -> subprocess.CompletedProcess[str]:
    """Run a command whose lock Redis is reached through a :class:`HoldingProxy`:
    once it has read ``hold_on`` and sends its delete, ``change()`` runs (the
    key changes hands by the test's own client), then the delete goes on."""
    proxy = HoldingProxy(scene.server.port, hold_on)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "singleton", *args],
            env=env_with_lock_url(scene, proxy.url(2)), cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: proxy.reached.is_set() or proc.poll() is not None, 60,
                     what="the command's write, or its end")
            if not proxy.reached.is_set():
                out, err = proc.communicate()
                raise AssertionError(f"the command wrote nothing on {hold_on}: "
                                     f"exit {proc.returncode}\n{out}{err}")
            change()
        except BaseException:
            proc.kill()
            raise
        finally:
            proxy.go.set()
        out, err = proc.communicate(timeout=60)
    finally:
        proxy.close()
    assert SECRET not in out + err, "an argument value was printed"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def take_over(scene: Scene, keys: LockKeys, name: str, host: str = "w2@host") -> str:
    """The second client: the lock's holder lets it go (as a lease running out
    would) and another execution takes it at once. The new holder's task id."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect

    engine = connect(SingletonConfig.defaults(scene.server.url(2)))
    try:
        old = owner_record(scene.locks, keys.lock)
        assert engine.release(keys, old["exec"], old["task"], finished=False)
        task_id = f"next-{uuid.uuid4().hex[:8]}"
        engine.acquire(keys, Request(task_id=task_id, exec_id=f"{task_id}-exec",
                                     lease=Lease.of_ms(120_000), hostname=host, retries=0,
                                     task_name=name))
    finally:
        engine.close()
    assert owner_record(scene.locks, keys.lock)["task"] == task_id
    return task_id


def test_release_says_changed_when_the_key_changed_hands_since_it_was_read(scene):
    """docs/operating.md:21, :111: a release whose key changed hands between
    its read and its release answers "changed" and exits 1; the release is
    owner-checked, so the new holder keeps its lock. A dead holder's lock
    (released without --force) is taken over by another execution at that
    moment; so is a send-time marker released with --force."""
    name = "t.hold"
    for form in (["--json"], []):
        keys = scene.app.tasks[name].singleton_keys(f"moved-{uuid.uuid4().hex}")
        old_id, _ = hold_stale(scene.server, keys, name)
        taken: list[str] = []

        def change(keys: LockKeys = keys, taken: list[str] = taken) -> None:
            taken.append(take_over(scene, keys, name))

        out = cli_while_changing_hands(scene, keys.lock, change, "release", keys.base, *form)
        assert out.returncode == 1, out.stdout + out.stderr
        if form:
            answer = json.loads(out.stdout)
            assert (answer["action"], answer["holder"], answer["live"]) == (
                "changed", old_id, "dead")
        else:
            assert out.stdout.strip() == (f"not released: {keys.base} changed hands since it "
                                          "was read; run release again")
        assert owner_record(scene.locks, keys.lock)["task"] == taken[0], "the new holder keeps it"
        assert cli(scene, "release", keys.base, "--force").returncode == 0

    t = scene.app.tasks["t.queue"]
    key = f"mq-{uuid.uuid4().hex}"
    sent = t.apply_async(kwargs={"key": key}, countdown=60)
    queued = t.singleton_keys(key)
    assert marker(scene.locks, queued.queued) == ("t.queue", sent.id)
    later = f"later-{uuid.uuid4().hex[:8]}"

    def requeue() -> None:  # the queued task ran; a new send took the key
        from celery_singleton_lock import SingletonConfig
        from celery_singleton_lock.engine.registry import connect

        engine = connect(SingletonConfig.defaults(scene.server.url(2)))
        try:
            assert engine.unqueue(queued, sent.id)
            engine.enqueue(queued, later, "queue", 120_000, task_name="t.queue")
        finally:
            engine.close()

    forced = cli_while_changing_hands(scene, queued.queued, requeue, "release", queued.base,
                                      "--force", "--json")
    assert forced.returncode == 1, forced.stdout + forced.stderr
    answer = json.loads(forced.stdout)
    assert (answer["action"], answer["holder"], answer["state"]) == ("changed", sent.id,
                                                                     "queued")
    assert marker(scene.locks, queued.queued) == ("t.queue", later), "the new sender keeps it"
    scene.locks.delete(queued.queued)
    sent.revoke()


@pytest.mark.parametrize("force", [False, True], ids=["yes", "yes-force"])
def test_purge_keeps_a_key_that_changed_hands_since_it_was_read_even_with_force(scene, force):
    """docs/operating.md:21, :151 and docs/migration.md:37: `purge --yes` frees
    locks owner-checked, so a lock that changed hands between its read and its
    delete is kept ("changed hands: kept", exit 1), and `--force` does not make
    it free the new holder's lock either. Without --force the read holder is
    dead (so purge tries to free it); with --force it may still run."""
    name = "t.hold_soft" if force else "t.hold_late"
    keys = scene.app.tasks[name].singleton_keys(f"pm-{uuid.uuid4().hex}")
    if force:
        old_id = hold_on_another_host(scene, keys, name)
    else:
        old_id, _ = hold_stale(scene.server, keys, name)
    taken: list[str] = []
    out = cli_while_changing_hands(
        scene, keys.lock, lambda: taken.append(take_over(scene, keys, name)),
        "purge", "--task", name, "--yes", "--json", *(["--force"] if force else []))
    assert out.returncode == 1, out.stdout + out.stderr
    outcome = {e["key"]: e for e in json.loads(out.stdout)["keys"]}
    assert (outcome[keys.base]["action"], outcome[keys.base]["holder"]) == (
        "changed hands: kept", old_id)
    assert owner_record(scene.locks, keys.lock)["task"] == taken[0], "the new holder keeps it"
    assert cli(scene, "release", keys.base, "--force").returncode == 0
