"""The same task id delivered twice: never concurrent, never lost."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any, Iterator

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from kombu.transport import redis as kombu_redis

from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

# Redelivered by the broker after 2 s without an ack; scanned for often.
FAST_REDELIVERY = {
    "singleton_ttl": 30.0,
    "broker_transport_options": {
        "visibility_timeout": 2,
        "unacked_restore_interval": 0.5,
        "unacked_restore_throttle": 1,
    },
}


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer) -> Iterator[Worker]:
    w = Worker(redis_server.url(), f"redeliver-{uuid.uuid4().hex[:8]}", concurrency=3,
               conf=FAST_REDELIVERY).start()
    yield w
    discard(w)


@pytest.fixture(scope="module")
def app(redis_server: RedisServer, worker: Worker) -> Any:
    return make_app(redis_server.url(), worker.queue, conf=FAST_REDELIVERY)


@pytest.fixture
def sweeps(app: Any) -> Iterator[None]:
    """Kombu before 5.5 has no ``unacked_restore_interval``: a worker looks for
    messages past their visibility timeout only about every 100 s. There the
    test runs kombu's own sweep (``restore_visible``) twice a second itself."""
    if hasattr(kombu_redis.Channel, "unacked_restore_interval"):
        yield
        return
    stop = threading.Event()

    def sweep() -> None:
        with app.connection_for_write() as conn:
            qos = conn.default_channel.qos
            while not stop.wait(0.5):
                qos.restore_visible(num=100, interval=1)

    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(5)


def in_broker(server: RedisServer, queue: str, task_id: str) -> bool:
    """Whether the broker still holds a message of ``task_id``: waiting in the
    queue, or delivered and not acknowledged (kombu's ``unacked`` hash, from
    where a visibility timeout would deliver it again)."""
    broker = server.client(0)
    return any(task_id in m for m in (*broker.lrange(queue, 0, -1), *broker.hvals("unacked")))


def settled(worker: Worker, server: RedisServer, name: str, task_id: str) -> bool:
    """Every delivery of ``task_id`` the worker received was handled and
    acknowledged: it ran to its end ("succeeded", or "raised unexpected": a
    failure), or Celery was told to let it go ("ignored": a copy dropped, or
    sent again to wait for its running original), and the broker holds no
    message of it, so no copy of it can run any more."""
    logs = worker.logs()
    received = logs.count(f"Task {name}[{task_id}] received")
    handled = (logs.count(f"Task {name}[{task_id}] succeeded")
               + logs.count(f"Task {name}[{task_id}] raised unexpected")
               + logs.count(f"Task {name}[{task_id}] ignored"))
    return received > 0 and received == handled and not in_broker(server, worker.queue, task_id)


@pytest.mark.usefixtures("sweeps")
def test_visibility_timeout_copy_waits_for_original_then_is_dropped(app, worker, redis_server,
                                                                   r, events, key):
    """acks_late task running past the visibility timeout: the broker delivers it
    again with the same id while it runs; the copy neither runs alongside nor
    runs after the original finished."""
    res = app.tasks["t.hold_late"].delay(key, 6.0, "orig")
    wait_for(lambda: events.starts("orig"), 10, what="original start")
    assert res.get(timeout=30)["tag"] == "orig"
    # every copy the broker delivered was handled and acked: none is left to run
    wait_for(lambda: settled(worker, redis_server, "t.hold_late", res.id), 30,
             what="every delivery of the task handled and acknowledged")
    starts = [e for e in events.starts() if e["id"] == res.id]
    assert len(starts) == 1, starts
    # the broker did deliver a copy while the original ran, and it waited
    assert f"hold_late[{res.id}] waits for its running original" in worker.logs()
    assert f"Dropped redelivered t.hold_late[{res.id}]" in worker.logs()
    assert res.state == "SUCCESS"
    assert not r.exists(app.tasks["t.hold_late"].singleton_keys(key).lock)


@pytest.mark.usefixtures("sweeps")
def test_visibility_timeout_copy_of_a_failed_original_is_dropped(app, worker, redis_server,
                                                                r, events, key):
    """As above, with an original that fails: a failure is an outcome Celery
    records, so the copy that waited for the running original is dropped once
    it failed, not run a second time. The original fails by its pool's soft
    time limit, raised when the copy is seen waiting (the signal the pool sends
    when a ``soft_time_limit`` runs out, here sent by the test)."""
    task = app.tasks["t.hold_late"]
    res = task.delay(key, 120.0, "fails")
    original = wait_for(lambda: events.starts("fails"), 10, what="original start")[0]
    wait_for(lambda: f"hold_late[{res.id}] waits for its running original" in worker.logs(),
             30, what="a redelivered copy waiting for its running original")
    os.kill(original["pid"], signal.SIGUSR1)  # SoftTimeLimitExceeded in the body
    with pytest.raises(SoftTimeLimitExceeded):
        res.get(timeout=30)
    events.client.set(f"finish:{key}", 1)  # a copy run by mistake need not last 120 s
    wait_for(lambda: f"Dropped redelivered t.hold_late[{res.id}]" in worker.logs()
             or len(events.starts("fails")) > 1, 30, what="the waiting copy handled")
    runs = [e for e in events.starts() if e["id"] == res.id]
    assert len(runs) == 1, f"the copy of the failed original ran again: {runs}"
    wait_for(lambda: settled(worker, redis_server, "t.hold_late", res.id), 30,
             what="every delivery of the task handled and acknowledged")
    assert len([e for e in events.starts() if e["id"] == res.id]) == 1
    assert app.AsyncResult(res.id).state == "FAILURE"
    assert not r.exists(task.singleton_keys(key).lock)


def test_redelivery_after_child_killed_runs_at_once(app, r, events, key):
    """acks_late + reject_on_worker_lost, child killed: Celery fires no signal and
    requeues the same id; the copy finds the lock of a dead process and runs,
    without waiting for the 30 s lease."""
    res = app.tasks["t.hold_late"].delay(key, 3.0, "lost")
    first = wait_for(lambda: events.starts("lost"), 10, what="first start")[0]
    t0 = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    assert res.get(timeout=30)["tag"] == "lost"
    starts = [e for e in events.starts("lost") if e["id"] == res.id]
    assert len(starts) == 2
    assert starts[1]["pid"] != first["pid"]
    assert starts[1]["token"] > first["token"]
    assert time.monotonic() - t0 < 20
    assert not r.exists(app.tasks["t.hold_late"].singleton_keys(key).lock)


def test_same_id_sent_again_after_finish_is_dropped(app, worker, redis_server, r, events, key):
    """A late copy of a finished acks_late task does not run a second time and
    leaves the stored result alone."""
    task = app.tasks["t.hold_late"]
    res = task.delay(key, 0.0, "done")
    assert res.get(timeout=10)["tag"] == "done"
    task.apply_async((key, 0.0, "done-again"), task_id=res.id)
    wait_for(lambda: f"Dropped redelivered t.hold_late[{res.id}]" in worker.logs()
             or len(events.starts("done")) > 1, 20, what="the late copy handled")
    wait_for(lambda: settled(worker, redis_server, "t.hold_late", res.id), 20,
             what="both deliveries handled and acknowledged")
    assert [e["tag"] for e in events.starts() if e["id"] == res.id] == ["done"]
    assert app.AsyncResult(res.id).get(timeout=5)["tag"] == "done"


def test_a_task_id_sent_twice_whose_first_run_retried_runs_once_and_its_retry(
        app, worker, redis_server, events, key):
    """The same task id sent twice (a repeated webhook under its idempotency
    key as task id; no ``acks_late``): the second delivery waits for the
    running first one, which retries; the retry runs and succeeds, and the
    waiting delivery is then dropped, not run a second time. (Before, the
    retry's take-back of the key dropped the mark the waiting delivery had
    left, the retry's end left no finish marker, and the waiting delivery,
    asking after it, ran the task again.)"""
    task = app.tasks["t.retrier"]
    call = dict(attempts=1, countdown=0.2, seconds=120.0, tag="pay")
    res = task.apply_async((key,), call)
    wait_for(lambda: events.starts("pay#0"), 15, what="the first run")
    task.apply_async((key,), call, task_id=res.id)  # the same id, again
    wait_for(lambda: f"t.retrier[{res.id}] waits for its running original" in worker.logs(),
             30, what="the second delivery waiting for the first")
    events.client.set(f"finish:{key}", 1)  # the first run ends and retries
    assert res.get(timeout=30)["tag"] == "pay#1"
    wait_for(lambda: f"Dropped redelivered t.retrier[{res.id}]" in worker.logs()
             or len(events.starts("pay#0")) > 1, 30, what="the waiting delivery handled")
    runs = [e["tag"] for e in events.starts() if e["id"] == res.id]
    assert runs == ["pay#0", "pay#1"], f"the task ran again after its retry: {runs}"
    # no delivery of it is left to run (a retry's own "retry:" line is no end,
    # so settled() does not apply)
    wait_for(lambda: not in_broker(redis_server, worker.queue, res.id), 30,
             what="no message of the task left in the broker")
    assert [e["tag"] for e in events.starts() if e["id"] == res.id] == ["pay#0", "pay#1"]
