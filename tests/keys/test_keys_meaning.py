"""A key means what the user means, on real prefork workers and a real Redis:

* a ``pydantic=True`` task's equal models are one key, whatever form the caller
  sent (model, dict, dict with defaults spelled out, strings Celery coerces);
* a call whose model does not validate is refused at send, naming pydantic's reason;
* a task migrated from celery-singleton with ``unique_on`` left in does not start;
* during a rollout (``singleton_also_lock``), a worker of celery-singleton or
  celery-once and one of this library never run one call at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from celery_singleton_lock import (
    ConfigurationError,
    InvalidArgumentsError,
    is_deduplicated,
    is_skipped,
)
from celery_singleton_lock.testing import CeleryWorker
from tests.keysapp import Order, make_app, recorder
from tests.support import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.worker

#: four forms of one order: Celery validates each into Order(id=2, note=None)
FORMS: list[Any] = [{"id": 2}, {"id": 2, "note": None}, {"id": "2"}, Order(id=2)]


def keys_worker(server: RedisServer, queue: str, lib: str = "new", also: Any = None,
                concurrency: int = 2, extra: Optional[dict[str, str]] = None) -> CeleryWorker:
    env = {
        "KEYS_REDIS_URL": server.url(),
        "KEYS_QUEUE": queue,
        "KEYS_LIB": lib,
        "KEYS_ALSO": json.dumps(also) if also is not None else "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(extra or {}),
    }
    return CeleryWorker("tests.keysapp:app", queue, concurrency=concurrency, env=env,
                        cwd=str(ROOT), name=f"{lib}-{uuid.uuid4().hex[:6]}@%h")


def runs(server: RedisServer, key: str) -> list[dict[str, Any]]:
    events = [json.loads(e) for e in recorder(server.url()).lrange("events", 0, -1)]
    return [e for e in events if e["key"] == key]


@pytest.fixture(scope="module")
def two_workers(redis_server: RedisServer) -> Iterator[tuple[str, list[CeleryWorker]]]:
    """Two prefork workers of the new library on one queue."""
    queue = f"keys-{uuid.uuid4().hex[:8]}"
    workers = [keys_worker(redis_server, queue).start() for _ in range(2)]
    yield queue, workers
    for w in workers:
        w.stop(timeout=0)


@pytest.fixture
def fresh(redis_server: RedisServer) -> RedisServer:
    recorder(redis_server.url()).delete("events")
    return redis_server


def test_queue_scope_one_order_in_four_forms_runs_once_and_the_others_are_deduplicated(
        two_workers: tuple[str, list[CeleryWorker]], fresh: RedisServer) -> None:
    queue, _ = two_workers
    task = make_app(fresh.url(), queue).tasks["k.charge_queued"]
    first, *rest = [task.delay(form) for form in FORMS]
    assert not is_deduplicated(first)
    assert [is_deduplicated(r) for r in rest] == [True, True, True]
    assert {r.holder for r in rest} == {first.id}
    first.get(timeout=30)
    assert [e["id"] for e in runs(fresh, "order-2") if e["ev"] == "start"] == [first.id]


def test_run_scope_one_order_in_four_forms_never_runs_twice_at_once(
        two_workers: tuple[str, list[CeleryWorker]], fresh: RedisServer) -> None:
    queue, _ = two_workers
    task = make_app(fresh.url(), queue).tasks["k.charge"]
    skipped = ran = 0
    for _ in range(3):  # four workers' processes, four forms sent at once
        results = [task.delay(form) for form in FORMS]
        for res in results:
            out = res.get(timeout=30)
            skipped += is_skipped(out)
            ran += not is_skipped(out)
    starts = [e for e in runs(fresh, "order-2") if e["ev"] == "start"]
    assert max(e["concurrent"] for e in starts) == 1, starts
    assert ran == len(starts) >= 3 and skipped == 12 - ran


def test_an_order_that_does_not_validate_is_refused_at_send_with_pydantics_reason(
        two_workers: tuple[str, list[CeleryWorker]], fresh: RedisServer) -> None:
    queue, _ = two_workers
    app = make_app(fresh.url(), queue)
    broker = fresh.client(0)
    before = broker.llen(queue)
    for name in ("k.charge", "k.charge_queued"):
        with pytest.raises(InvalidArgumentsError) as err:
            app.tasks[name].delay({"id": "card-4111"})
        text = str(err.value)
        assert "'order'" in text and "Order" in text and "valid integer" in text, text
        assert "4111" not in text  # pydantic's reason, never the value sent
        with pytest.raises(InvalidArgumentsError):
            app.tasks[name].singleton_keys({"note": "no id"})
    assert broker.llen(queue) == before  # nothing was sent


def test_none_for_a_required_order_is_refused_at_send_not_at_run(
        two_workers: tuple[str, list[CeleryWorker]], fresh: RedisServer) -> None:
    """``None`` for ``order: Order`` (required, not ``Optional``) could never
    run: Celery's wrapper refuses it before the body. It is refused at send,
    by ``delay`` and ``apply_async``, positional or named, under the run and
    the queue scopes: nothing sent, no send-time key taken, nothing run."""
    queue, _ = two_workers
    app = make_app(fresh.url(), queue)
    broker, locks = fresh.client(0), fresh.client(2)
    before, keys_before = broker.llen(queue), set(locks.scan_iter("singleton:*"))
    for name in ("k.charge", "k.charge_queued"):
        task = app.tasks[name]
        for args, kwargs in (((None,), {}), ((), {"order": None})):
            for send in (task.delay, None):
                with pytest.raises(InvalidArgumentsError) as err:
                    if send is None:
                        task.apply_async(args, kwargs)
                    else:
                        send(*args, **kwargs)
                assert "'order'" in str(err.value) and "Order" in str(err.value), err.value
    assert broker.llen(queue) == before  # nothing was sent
    assert set(locks.scan_iter("singleton:*")) == keys_before  # no send-time key taken
    assert not [e for e in recorder(fresh.url()).lrange("events", 0, -1)]


def test_singleton_keys_and_the_cli_key_command_agree_for_every_form(
        two_workers: tuple[str, list[CeleryWorker]], fresh: RedisServer) -> None:
    queue, _ = two_workers
    task = make_app(fresh.url(), queue).tasks["k.charge"]
    keys = {task.singleton_keys(form).base for form in FORMS}
    assert len(keys) == 1
    assert task.singleton_keys({"id": 3}).base not in keys
    env = {**os.environ, "KEYS_REDIS_URL": fresh.url(), "KEYS_QUEUE": queue,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for form in ({"id": "2"}, {"id": 2, "note": None}):
        out = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.keysapp:app", "singleton", "key",
             "k.charge", "--args", json.dumps([form]), "--json"],
            env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["key"] in keys
    bad = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.keysapp:app", "singleton", "key",
         "k.charge", "--args", json.dumps([{"id": "x"}])],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a valid Order" in bad.stderr, bad.stderr


# -- a task migrated from celery-singleton ------------------------------------------

def test_a_task_that_kept_celery_singletons_unique_on_stops_the_worker_and_the_send(
        redis_server: RedisServer) -> None:
    queue = f"mig-{uuid.uuid4().hex[:8]}"
    worker = keys_worker(redis_server, queue, extra={"KEYS_MIGRATED": "1"})
    worker.start(wait=False)
    assert worker.proc is not None
    worker.proc.wait(60)
    said = worker.output() + worker.logs()
    assert worker.proc.returncode != 0
    assert "unique_on" in said and "singleton_key=('account_id',)" in said, said
    app = make_app(redis_server.url(), queue, migrated=True)
    with pytest.raises(ConfigurationError, match=r"unique_on.*singleton_key=\('account_id',\)"):
        app.tasks["m.migrated"].delay(7, full=True)
    assert redis_server.client(0).llen(queue) == 0


# -- a rollout over a fleet that still runs the old library ----------------------------

def roll(server: RedisServer, old: str, also: Any, calls: int = 200) -> dict[str, Any]:
    """An old-library worker and a new one on one queue; ``calls`` calls over four
    accounts, sent in turn by an old-library caller and a new one."""
    rec = recorder(server.url())
    rec.delete("events")
    server.client(4).flushdb()
    queue = f"roll-{uuid.uuid4().hex[:8]}"
    workers = [keys_worker(server, queue, lib=old, concurrency=2),
               keys_worker(server, queue, also=also, concurrency=2)]
    for w in workers:
        w.start()
    try:
        senders = [make_app(server.url(), queue, lib=old).tasks["r.work"],
                   make_app(server.url(), queue, also=also).tasks["r.work"]]
        rng = random.Random(7)
        sent = []
        for n in range(calls):
            res = senders[n % 2].apply_async(
                (rng.randrange(4),), {"seconds": rng.uniform(0.02, 0.15), "tag": f"c{n}"})
            if getattr(res, "state", None) != "REJECTED" and not is_deduplicated(res):
                sent.append(res)
            time.sleep(rng.uniform(0.0, 0.03))
        for res in sent:
            res.get(timeout=60, propagate=False)
        # every message handled: nothing queued, nothing running
        wait_for(lambda: server.client(0).llen(queue) == 0 and all(
            int(rec.get(f"active:{a}") or 0) == 0 for a in range(4)), 30,
            what="queue drained")
        if also is not None:  # the last runs' ends delete their old keys
            with contextlib.suppress(AssertionError):
                wait_for(lambda: server.client(4).dbsize() == 0, 10)
    finally:
        for w in workers:
            w.stop(timeout=0)
    events = [json.loads(e) for e in rec.lrange("events", 0, -1)]
    starts = [e for e in events if e["ev"] == "start"]
    return {"starts": starts, "overlaps": sum(e["concurrent"] > 1 for e in starts),
            "by": {lib: sum(e["lib"] == lib for e in starts) for lib in (old, "new")},
            "left": server.client(4).dbsize()}


@pytest.mark.parametrize("old", ["celery_singleton", "celery_once"])
def test_a_rollout_beside_the_old_library_runs_no_call_twice_at_once(
        redis_server: RedisServer, old: str) -> None:
    base = redis_server.url().rsplit("/", 1)[0]
    on = roll(redis_server, old, {"library": old, "url": f"{base}/4"})
    assert on["overlaps"] == 0, on
    assert on["by"][old] >= 10 and on["by"]["new"] >= 10, on["by"]
    assert on["left"] == 0  # every run deleted the old library's key
    # without the mode, the same fleet runs calls twice at once: the window it closes
    off = roll(redis_server, old, None)
    assert off["overlaps"] > 0, off["by"]


@pytest.mark.parametrize("old", ["celery_singleton", "celery_once"])
def test_a_rollout_under_queue_and_run_runs_every_call_sent_while_nothing_runs(
        redis_server: RedisServer, old: str) -> None:
    """The migration guide's own setup: the old library's tasks become
    ``singleton_scope="queue_and_run"`` with ``singleton_also_lock``. An old
    worker and a new one, calls of one account sent one at a time (each after
    the last one ended) by an old caller and a new one to either worker, in
    turn through every pairing, after a burst: every call runs. (Before: a
    new caller's message run by an old worker left our send-time key for
    ``singleton_queue_ttl``, so later new sends were turned away as
    duplicates of a finished call and old senders' messages skipped as
    "queued": 13 of 16 ran on a fresh Redis, 3 of 16 after a 200-call burst.)"""
    base = redis_server.url().rsplit("/", 1)[0]
    also = {"library": old, "url": f"{base}/4"}
    rec = recorder(redis_server.url())
    rec.delete("events")
    redis_server.client(4).flushdb()
    tag = uuid.uuid4().hex[:8]
    queues = {"old": f"rollq-old-{tag}", "new": f"rollq-new-{tag}"}
    workers = [keys_worker(redis_server, queues["old"], lib=old, concurrency=1),
               keys_worker(redis_server, queues["new"], also=also, concurrency=1,
                           extra={"KEYS_SCOPE": "queue_and_run"})]
    for w in workers:
        w.start()
    try:
        senders = {"old": make_app(redis_server.url(), queues["old"], lib=old).tasks["r.work"],
                   "new": make_app(redis_server.url(), queues["old"], also=also,
                                   scope="queue_and_run").tasks["r.work"]}
        pairings = [(sender, worker) for sender in ("new", "old") for worker in ("old", "new")]
        lock_key = senders["new"].singleton_keys(7).lock
        burst = [senders[s].apply_async((7,), {"seconds": 0.0, "tag": f"b{n}"}, queue=queues[w])
                 for n, (s, w) in enumerate(pairings * 10)]
        for res in burst:
            if getattr(res, "state", None) != "REJECTED" and not is_deduplicated(res):
                res.get(timeout=60, propagate=False)
        # drained: no message left, no body running, and both libraries' keys freed
        wait_for(lambda: all(redis_server.client(0).llen(q) == 0 for q in queues.values())
                 and int(rec.get("active:7") or 0) == 0
                 and redis_server.client(4).dbsize() == 0
                 and not redis_server.client(2).exists(lock_key), 30, what="the burst drained")
        for n, (s, w) in enumerate(pairings * 4):
            sent = senders[s].apply_async((7,), {"seconds": 0.0, "tag": f"one{n}"},
                                          queue=queues[w])
            try:
                wait_for(lambda t=f"one{n}": any(e["tag"] == t and e["ev"] == "end"
                                                 for e in runs(redis_server, "7")), 30,
                         what=f"call {n}, sent by the {s} caller to the {w} worker, to run")
                # ended: its body returned and both libraries freed their keys (a
                # call sent while a worker still frees them is a duplicate of a
                # running one, refused under queue_and_run as it should be)
                wait_for(lambda: redis_server.client(4).dbsize() == 0
                         and not redis_server.client(2).exists(lock_key), 30,
                         what=f"call {n}'s keys freed")
            except AssertionError:
                _say_where_the_call_went(redis_server, sent, workers, queues)
                raise
        ran = {e["tag"] for e in runs(redis_server, "7") if e["ev"] == "start"}
        assert {f"one{n}" for n in range(16)} <= ran
    finally:
        for w in workers:
            w.stop(timeout=0)


def _say_where_the_call_went(server: RedisServer, sent: Any, workers: list[CeleryWorker],
                             queues: dict[str, str]) -> None:
    """The history a lost call leaves: its send's answer, the keys of both
    libraries, the queues, the last runs and each worker's log."""
    print("send:", type(sent).__name__, getattr(sent, "state", None),
          getattr(sent, "id", None), is_deduplicated(sent))
    for db in (2, 4):
        client = server.client(db)
        for key in client.keys("*"):
            kind = client.type(key)
            value = client.get(key) if kind == "string" else kind
            print(f"db{db} {key!r} = {value!r} pttl={client.pttl(key)}")
    print("queues:", {q: server.client(0).llen(q) for q in queues.values()})
    print("last runs:", runs(server, "7")[-8:])
    for w in workers:
        print(f"--- {w.name}\n{w.logs()[-6000:]}")


def test_during_a_rollout_the_old_key_lives_as_long_as_the_run_and_frees_after_a_kill(
        redis_server: RedisServer) -> None:
    """celery-singleton's own key never expires; taken by a SingletonTask it is
    renewed with our lease while the run lives (a run of 3 leases keeps it and an
    old caller is refused meanwhile), and a killed child leaves it for a lease."""
    base = redis_server.url().rsplit("/", 1)[0]
    also = {"library": "celery_singleton", "url": f"{base}/4"}
    queue = f"roll-{uuid.uuid4().hex[:8]}"
    old_locks = redis_server.client(4)
    worker = keys_worker(redis_server, queue, also=also, concurrency=1).start()
    try:
        new = make_app(redis_server.url(), queue, also=also).tasks["r.work"]
        old = make_app(redis_server.url(), queue, lib="celery_singleton").tasks["r.work"]
        other = new.singleton_settings().other
        assert other is not None
        old_key = other.key((41,), {})
        long_run = new.apply_async((41,), {"seconds": 6.0, "tag": "long"})
        wait_for(lambda: any(e["ev"] == "start" for e in runs(redis_server, "41")), 30,
                 what="the long run started")
        wait_for(lambda: any(e["ev"] == "start" for e in runs(redis_server, "41"))
                 and old_locks.pttl(old_key) > 0, 5)
        # past our 2 s lease, twice: the old key is still held, renewed with ours
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started > 4.5, 10)
        assert old_locks.get(old_key) == long_run.id
        refused = old.apply_async((41,), {"seconds": 0.0, "tag": "old"})
        assert refused.id == long_run.id  # celery-singleton returns the holder's result
        long_run.get(timeout=30)
        wait_for(lambda: not old_locks.exists(old_key), 10, what="old key deleted at the end")

        killed = new.apply_async((42,), {"seconds": 60.0, "tag": "killed"})
        key42 = other.key((42,), {})
        wait_for(lambda: old_locks.exists(key42) and any(
            e["ev"] == "start" for e in runs(redis_server, "42")), 30)
        for child in worker.children():
            os.kill(child, 9)
        # never expires as celery-singleton takes it; taken by us, it frees with our lease
        wait_for(lambda: not old_locks.exists(key42), 15, what="old key freed after the kill")
        assert killed.id
    finally:
        worker.stop(timeout=0)
