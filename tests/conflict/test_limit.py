"""``singleton_limit = N``: at most N executions per key at once, each in a
slot of its own with its own fencing token, across two prefork workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from typing import Any, Iterator

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, SingletonTask, is_skipped
from celery_singleton_lock.engine.request import Lease, Request
from tests.cli.test_cli import run_cli
from tests.support import ROOT, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def two_workers(redis_server: Any) -> Iterator[tuple[Worker, Worker]]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    workers = (Worker(redis_server.url(), queue, concurrency=3, name="a").start(),
               Worker(redis_server.url(), queue, concurrency=3, name="b").start())
    yield workers
    for w in workers:
        discard(w)


@pytest.fixture(scope="module")
def app(redis_server: Any, two_workers: tuple[Worker, Worker]) -> Any:
    return make_app(redis_server.url(), two_workers[0].queue)


def test_at_most_n_run_at_once_each_in_its_own_slot(app, events, key, two_workers):
    """Eight calls of one key on six processes: never more than three run at
    once, each in one of slots 1 to 3 with its own token; the calls that start
    while three run are skipped naming a holder. While three run, `celery
    singleton key` shows 3/3 slots used."""
    t = app.tasks["t.limit3"]
    calls = [t.delay(key, 120.0, f"c{i}") for i in range(8)]  # ended by the test
    wait_for(lambda: len(events.starts()) >= 3, 15, what="three starts")
    out = run_cli(two_workers[0].env, "key", "t.limit3", "--args", json.dumps([key]), "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert (shown["limit"], shown["slots_used"]) == (3, 3)
    assert sorted(r["slot"] for r in shown["locks"] if r["state"] == "run") == [1, 2, 3]
    # the workers say which slot each of their held locks is in: `celery
    # inspect singleton_locks`, and the stats rows Flower's worker page shows
    lockkey = events.starts()[0]["lockkey"].split(":lock")[0]

    def stats_rows() -> Any:
        stats = app.control.inspect(timeout=5, limit=len(two_workers)).stats() or {}
        rows = [k for node in stats.values() for k in node if k.startswith(lockkey)]
        return rows if len(rows) == 3 else None

    rows = wait_for(stats_rows, 15, what="three held slots in the workers' stats")
    assert sorted(rows) == [f"{lockkey} slot {n}" for n in (1, 2, 3)], rows

    def inspected() -> Any:
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "inspect",
             "singleton_locks", "--json", "--timeout", "5"],
            env=two_workers[0].env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        held = [lock for reply in json.loads(out.stdout or "{}").values()
                for lock in (reply.get("locks") or ()) if lock["key"].startswith(lockkey)]
        return held if len(held) == 3 else None

    held = wait_for(inspected, 15, what="three held slots in celery inspect")
    assert sorted(lock["slot"] for lock in held) == [1, 2, 3]
    events.client.set(f"finish:{key}", 1)  # seen while three run: end them (and any after)
    results = [c.get(timeout=30) for c in calls]
    ran = [r for r in results if not is_skipped(r)]
    skipped = [r for r in results if is_skipped(r)]
    # a message a busy process had prefetched may start once a run ended
    assert len(ran) >= 3 and {r["slot"] for r in ran} == {1, 2, 3}
    assert len({r["token"] for r in ran}) == len(ran)
    ids = {c.id for c in calls}
    assert skipped and all(s["reason"] == "duplicate" and s["holder"] in ids
                           for s in skipped)
    assert max(e["concurrent"] for e in events.starts()) == 3


def test_retry_runs_every_call_never_more_than_n_and_tokens_go_up(app, events, key):
    t = app.tasks["t.limit2_retry"]
    calls = [t.delay(key, 0.5, f"r{i}") for i in range(4)]
    results = [c.get(timeout=60) for c in calls]
    assert not any(is_skipped(r) for r in results)
    starts = events.starts()
    assert len(starts) == 4 and max(e["concurrent"] for e in starts) <= 2
    assert len({e["token"] for e in starts}) == 4
    # a run that started after another ended holds a greater token
    ends = {e["tag"]: e["t"] for e in events.ends()}
    assert all(b["token"] > a["token"] for a in starts for b in starts
               if ends[a["tag"]] < b["t"])


def test_a_killed_child_frees_its_slot(app, events, key, r):
    """kill -9 of the child holding slot 2: the main worker process frees
    that slot (and only it), and the next call runs in it."""
    t = app.tasks["t.limit2"]
    holders = [t.delay(key, 60.0, f"h{i}") for i in range(2)]
    wait_for(lambda: len(events.starts("h")) == 2, 15, what="both slots taken")
    full = t.delay(key, 0.0, "full").get(timeout=10)
    assert is_skipped(full)
    keys = t.singleton_keys(key)
    starts = events.starts("h")  # each call parses the events anew: compare ids
    victim = next(e for e in starts
                  if r.get(keys.slot(2).lock) and r.get(keys.slot(2).lock).endswith(e["id"]))
    other = next(e for e in starts if e["id"] != victim["id"])
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: not r.exists(keys.slot(2).lock), 15, what="slot 2 freed")
    assert r.get(keys.slot(1).lock).endswith(other["id"])
    after = t.delay(key, 0.0, "after").get(timeout=10)
    assert not is_skipped(after) and after["slot"] == 2
    for h in holders:
        app.control.revoke(h.id, terminate=True)


def test_a_limit_goes_with_the_run_scope_only():
    app = Celery("bad", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=SingletonTask, name="bad.limit", singleton_limit=2,
              singleton_scope="queue", shared=False)
    def bad() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"singleton_limit: task 'bad\.limit': 2 per"):
        app.tasks["bad.limit"].singleton_settings()

    @app.task(base=SingletonTask, name="bad.zero", singleton_limit=0, shared=False)
    def zero() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"singleton_limit.*whole number >= 1"):
        app.tasks["bad.zero"].singleton_settings()


def test_every_exit_path_frees_its_slot(app, events, key, r):
    """A hard time limit and a revoke with terminate each free the slot of
    the execution they end, and only it."""
    t = app.tasks["t.limit2"]
    keys = t.singleton_keys(key)
    killed = t.apply_async((key, 30.0, "timed-out"), time_limit=3)
    wait_for(lambda: events.starts("timed-out"), 15, what="the start")
    long = t.delay(key, 60.0, "revoked")
    wait_for(lambda: events.starts("revoked"), 15, what="the second start")
    slots = {n: r.get(keys.slot(n).lock) for n in (1, 2)}
    assert all(slots.values())
    timed_out_slot = next(n for n, rec in slots.items() if rec.endswith(killed.id))
    wait_for(lambda: not r.exists(keys.slot(timed_out_slot).lock), 20,
             what="the timed-out execution's slot freed")
    assert r.get(keys.slot(3 - timed_out_slot).lock).endswith(long.id)
    app.control.revoke(long.id, terminate=True)
    wait_for(lambda: not r.exists(keys.slot(3 - timed_out_slot).lock), 20,
             what="the terminated execution's slot freed")


def test_slots_on_one_server(redis_server):
    """The engine: N grants with tokens that only go up, N+1 refused naming a
    holder; a copy of a running task id finds its original in its slot; a
    retry takes back the slot its attempt kept for it."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from celery_singleton_lock.engine.replies import Acquire
    from celery_singleton_lock.keys import LockKeys

    engine = connect(SingletonConfig.defaults(redis_server.url(2)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)

    def acquire(task_id: str, exec_id: str, retries: int = 0) -> Any:
        return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id,
                                            lease=Lease.of_ms(30_000), hostname="h",
                                            retries=retries, task_name="t",
                                            slots=3))

    grants = [acquire(f"t{i}", f"e{i}") for i in range(3)]
    assert [g.status for g in grants] == [Acquire.GRANTED] * 3
    assert [g.slot for g in grants] == [1, 2, 3]
    assert [g.token for g in grants] == sorted(g.token for g in grants)
    full = acquire("t3", "e3")
    assert full.status is Acquire.HELD and full.holder is not None
    assert full.holder.task_id == "t0"
    copy = acquire("t1", "e1-copy")
    assert copy.status is Acquire.SAME_TASK and copy.slot == 2
    assert engine.release(keys.slot(2), "e1", "t1")
    after = acquire("t3", "e3")
    assert after.status is Acquire.GRANTED and after.slot == 2
    assert after.token > max(g.token for g in grants)
    assert engine.hand_off(keys.slot(3), "e2", 1, 30_000)
    retried = acquire("t2", "e2-retry", retries=1)
    assert retried.status is Acquire.GRANTED and retried.slot == 3


def test_a_slot_whose_holder_died_unseen_is_taken_back(app, redis_server, events, key, r):
    """Slot 2 held by a process of this host that is gone (its reaper never
    ran: the record is all that is left), slot 1 by a live run: the next call
    frees slot 2 and runs in it instead of being skipped for a lease."""
    from celery_singleton_lock.keys import LockKeys
    from tests.cli.test_cli import hold_stale

    t = app.tasks["t.limit2"]
    keys = t.singleton_keys(key)
    live = t.delay(key, 60.0, "live")
    wait_for(lambda: events.starts("live"), 15, what="slot 1 taken")
    scratch = LockKeys("singleton:", uuid.uuid4().hex)
    hold_stale(redis_server, scratch, "t.limit2")  # a record whose process died
    r.set(keys.slot(2).lock, r.get(scratch.lock), px=60_000)
    result = t.delay(key, 0.0, "next").get(timeout=10)
    assert not is_skipped(result) and result["slot"] == 2
    app.control.revoke(live.id, terminate=True)
