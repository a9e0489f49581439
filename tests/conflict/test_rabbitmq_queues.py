"""RabbitMQ as the broker, with classic and with quorum queues: every wait the
library schedules reaches the worker when it is due, and no task is lost.

A RabbitMQ node of the test's own (tests/rabbit.py) with a ``delivery-limit``
of 20 on every quorum queue (RabbitMQ 4's default), two real prefork workers,
Celery's settings for quorum queues (a topic exchange, publisher confirms,
``worker_detect_quorum_queues``). With quorum queues Celery sends a countdown
through RabbitMQ's native delayed delivery (a chain of delay queues).

Each worker records every message it receives (tests/workerapp.py,
``received``): the tests check that none arrives more than ``LATE`` seconds
after its ETA and that a quorum queue's ``x-delivery-count`` stays far below
the limit. ``-s`` prints the figures.

``SLT_QUORUM_HOLD=45 SLT_QUORUM_DUPLICATES=16 SLT_QUORUM_DELAYS=1,30`` is the
long form of the duplicates test (a 45 s holder, 16 duplicates, the library's
default backoff).
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any, Iterator

import pytest

from tests.rabbit import RabbitNode
from tests.rateapp import make_rate_app
from tests.support import CuttableProxy, RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

#: RabbitMQ 4 sets this on every quorum queue by default
DELIVERY_LIMIT = 20
#: a message that arrives later than this after its ETA strayed
LATE = 5.0
HOLD = float(os.environ.get("SLT_QUORUM_HOLD", "7"))
DUPLICATES = int(os.environ.get("SLT_QUORUM_DUPLICATES", "6"))
#: singleton_retry_delay and singleton_retry_max_delay: every wait is
#: 2.56-3.84 s, routed through the delay queues as 2 s or (5 times in 8) 3 s,
#: binary 11: the 2 s queue, then the 1 s one. A message sent again with the
#: ``x-death`` of an earlier 3 s wait, which names the 1 s queue, comes back
#: into it by dead-lettering: RabbitMQ before 4.0.1 takes that for a cycle
DELAYS = [float(x) for x in os.environ.get("SLT_QUORUM_DELAYS", "3.2,3.2").split(",")]

QUEUE_TYPES = ["quorum", "classic"]
#: the longest runs on classic queues (the same waits as a Redis broker's) are
#: long runs (pytest -m long); on quorum queues they are in the default run
QUORUM_FIRST = ["quorum", pytest.param("classic", marks=pytest.mark.long)]


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitNode]:
    node = RabbitNode()
    try:
        node.start()
        node.set_policy("delivery-limit", ".*", {"delivery-limit": DELIVERY_LIMIT})
        yield node
    finally:
        node.cleanup()


def broker_conf(url: str, queue_type: str, **extra: Any) -> dict[str, Any]:
    """What Celery requires for quorum queues (and the same for classic ones)."""
    conf: dict[str, Any] = {
        "broker_url": url,
        "task_default_queue_type": queue_type,
        "task_default_exchange_type": "topic",
        "broker_transport_options": {"confirm_publish": True},
        "singleton_ttl": 30.0,
        "slt_record_received": True,
    }
    if queue_type == "quorum":
        conf["worker_detect_quorum_queues"] = True
    conf.update(extra)
    return conf


def received(events: Any, task_id: str = "") -> list[dict[str, Any]]:
    return [e for e in events.all() if e["ev"] == "received" and (
        not task_id or e["id"] == task_id)]


def check_deliveries(events: Any, rabbit: RabbitNode, queue_type: str, what: str
                     ) -> dict[str, Any]:
    """Every delayed message arrived within LATE of its ETA, none came near the
    delivery limit, and no delay queue holds a message: the figures."""
    got = received(events)
    late = [e["t"] - e["eta"] for e in got if e["eta"] is not None]
    counts = [int(e["delivery_count"] or 0) for e in got]
    figures = {"messages": len(got), "delayed": len(late),
               "latest_after_eta": round(max(late, default=0.0), 2),
               "max_delivery_count": max(counts, default=0),
               "max_x_death": max((e["deaths"] for e in got), default=0)}
    print(f"\n{what} [{queue_type}]: {figures}")
    assert max(late, default=0.0) < LATE, sorted(late)[-5:]
    assert figures["max_delivery_count"] <= 2 < DELIVERY_LIMIT, figures
    if queue_type == "quorum":
        assert figures["delayed"] > 0  # the waits did go through the delay queues
    assert delay_queues_drain(rabbit), rabbit.queues()
    return figures


def delay_queues_drain(rabbit: RabbitNode, timeout: float = LATE * 2) -> bool:
    """No message left in a delay queue (they are the node's, shared by the
    module's tests: one still on its way may take up to a few seconds)."""
    def empty() -> bool:
        return not any(q["messages"] for name, q in rabbit.queues().items()
                       if name.startswith("celery_delayed_"))
    try:
        return bool(wait_for(empty, timeout, interval=1, what="empty delay queues"))
    except AssertionError:
        return False


@pytest.mark.timeout(HOLD * 6 + DUPLICATES * 20 + 120)
@pytest.mark.parametrize("queue_type", QUORUM_FIRST)
def test_retry_duplicates_behind_a_long_holder_all_run_one_at_a_time(
        rabbit: RabbitNode, redis_server: RedisServer, events: Any, queue_type: str) -> None:
    """A holder runs HOLD seconds; DUPLICATES duplicates under ``retry`` wait for
    it, sent again after each backoff: every one runs, one at a time, none
    fails. On quorum queues a wait under a second used to fail the duplicate
    (``ValueError: countdown must be a positive number``), and a copy sent
    again with the ``x-death`` headers of its last trip through a delay queue
    strayed there for minutes."""
    queue = f"qdup-{queue_type}-{uuid.uuid4().hex[:6]}"
    conf = broker_conf(rabbit.url(), queue_type, singleton_retry_delay=DELAYS[0],
                       singleton_retry_max_delay=DELAYS[1])
    workers = [Worker(redis_server.url(), queue, concurrency=2, conf=conf).start()
               for _ in range(2)]
    try:
        app = make_app(redis_server.url(), queue, conf=conf)
        task = app.tasks["t.hold_retry"]
        key = uuid.uuid4().hex[:10]
        holder = task.delay(key, HOLD, "holder")
        wait_for(lambda: events.starts("holder"), 30, what="holder start")
        dups = [task.delay(key, 0.3, f"dup-{i}") for i in range(DUPLICATES)]
        deadline = HOLD * 4 + DUPLICATES * 10 + 60
        assert holder.get(timeout=deadline)["tag"] == "holder"
        for i, dup in enumerate(dups):
            assert dup.get(timeout=deadline)["tag"] == f"dup-{i}", dup.state
        starts = events.starts("dup-")
        assert sorted(e["tag"] for e in starts) == sorted(f"dup-{i}" for i in range(DUPLICATES))
        assert all(e["concurrent"] == 1 for e in events.starts()), events.starts()
        holder_end = events.ends("holder")[0]["t"]
        assert all(e["t"] >= holder_end for e in starts)
        figures = check_deliveries(events, rabbit, queue_type, "retry duplicates")
        waits = [w for w in (e["waits"] for e in received(events)) if w]
        print(f"  sent again {len(waits)} times, at most {max(waits, default=0)} times each; "
              f"the last duplicate ended {events.ends()[-1]['t'] - holder_end:.1f} s after "
              f"the holder")
        assert figures["messages"] == 1 + DUPLICATES + len(waits)
    finally:
        for w in workers:
            discard(w)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill", ["child", "worker"])
@pytest.mark.parametrize("queue_type", QUORUM_FIRST)
def test_a_copy_redelivered_while_its_original_runs_runs_once_the_original_dies(
        rabbit: RabbitNode, redis_server: RedisServer, events: Any, queue_type: str,
        kill: str) -> None:
    """Worker A runs an ``acks_late`` task and loses its broker connection:
    RabbitMQ delivers the message again, to worker B, while the original still
    runs. The copy waits for its original, sent again after each backoff. Then
    A's pool child (or all of A) is killed: the copy runs, once, and the task
    ends in SUCCESS. On quorum queues the copy's first wait used to fail it
    (recorded as FAILURE, its message acknowledged): with the original gone
    the task was lost."""
    queue = f"qcopy-{queue_type}-{uuid.uuid4().hex[:6]}"
    proxy = CuttableProxy(rabbit.port)
    conf = broker_conf(rabbit.url(), queue_type, singleton_retry_delay=DELAYS[0],
                       singleton_retry_max_delay=DELAYS[1])
    a_conf = {**conf, "broker_url": f"amqp://guest:guest@127.0.0.1:{proxy.port}//"}
    a = Worker(redis_server.url(), queue, concurrency=1, conf=a_conf).start()
    b = None
    try:
        app = make_app(redis_server.url(), queue, conf=conf)
        key = uuid.uuid4().hex[:10]
        res = app.tasks["t.hold_late"].delay(key, 120.0, "orig")
        original = wait_for(lambda: events.starts("orig"), 30, what="original start")[0]
        b = Worker(redis_server.url(), queue, concurrency=1, conf=conf).start()
        proxy.cut()  # A loses the broker; its child runs on
        waiting = f"Redelivered t.hold_late[{res.id}] waits for its running original"
        # the copy waits, and comes back to wait again, more than once
        wait_for(lambda: (b is not None and b.logs().count(waiting) >= 3) or (
            res.state == "FAILURE"), 90, what="the copy waiting three times")
        assert res.state not in ("FAILURE", "SUCCESS"), res.state
        if kill == "child":
            os.kill(original["pid"], signal.SIGKILL)
        else:
            a.kill_all()
        events.client.set(f"finish:{key}", 1)  # the copy's run need not last 120 s
        assert res.get(timeout=90)["tag"] == "orig"
        runs = [e for e in events.starts("orig") if e["id"] == res.id]
        ends = [e for e in events.ends("orig") if e["id"] == res.id]
        assert len(runs) == 2 and len(ends) == 1, (runs, ends)
        assert runs[1]["token"] > runs[0]["token"]
        assert ends[0]["pid"] == runs[1]["pid"] != original["pid"]
        figures = check_deliveries(events, rabbit, queue_type, f"copy, {kill} killed")
        copies = received(events, res.id)
        assert any(e["delivery_count"] for e in copies) == (queue_type == "quorum"), copies
        print(f"  the task's messages: {len(copies)}, x-delivery-count at most "
              f"{figures['max_delivery_count']}")
    finally:
        proxy.close()
        discard(a)
        if b is not None:
            discard(b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_a_debounce_under_a_second_is_sent_and_runs_once(
        rabbit: RabbitNode, redis_server: RedisServer, events: Any, queue_type: str) -> None:
    """``singleton_debounce=0.5``: a burst of three sends, only the last runs.
    On quorum queues the caller's send used to raise ``ValueError`` (a 0.5 s
    countdown through native delayed delivery)."""
    queue = f"qdeb-{queue_type}-{uuid.uuid4().hex[:6]}"
    conf = broker_conf(rabbit.url(), queue_type)
    w = Worker(redis_server.url(), queue, concurrency=2, conf=conf).start()
    try:
        app = make_app(redis_server.url(), queue, conf=conf)
        task = app.tasks["t.debounce_short"]
        key = uuid.uuid4().hex[:10]
        sent = [task.delay(key, 0.0, f"burst-{i}") for i in range(3)]
        assert sent[-1].get(timeout=60)["tag"] == "burst-2"
        for res in sent[:-1]:
            assert res.get(timeout=60)["reason"] == "replaced"
        assert [e["tag"] for e in events.starts("burst-")] == ["burst-2"]
        check_deliveries(events, rabbit, queue_type, "debounce 0.5 s")
    finally:
        discard(w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_a_task_waiting_for_the_lock_redis_runs_once_it_is_back(
        rabbit: RabbitNode, redis_server: RedisServer, own_redis: RedisServer, events: Any,
        queue_type: str) -> None:
    """The lock Redis down (``singleton_on_backend_error="retry"``): the task is
    sent again after 0.5-1 x ``singleton_retry_delay``, then runs once Redis
    is back. On quorum queues every such wait (always under a second with the
    tests' 0.2 s delay) used to fail the task with ``LockBackendError``."""
    queue = f"qback-{queue_type}-{uuid.uuid4().hex[:6]}"
    conf = broker_conf(rabbit.url(), queue_type)
    w = Worker(redis_server.url(), queue, concurrency=1, conf=conf,
               lock_url=own_redis.url(2)).start()
    try:
        app = make_app(redis_server.url(), queue, lock_url=own_redis.url(2), conf=conf)
        own_redis.stop()
        res = app.tasks["t.hold"].delay(uuid.uuid4().hex[:10], 0.0, "outage")
        retrying = f"Lock backend unavailable for t.hold[{res.id}]"
        wait_for(lambda: w.logs().count(retrying) >= 3 or res.state == "FAILURE", 60,
                 what="three attempts while the lock Redis is down")
        assert res.state != "FAILURE", res.state
        own_redis.start()
        assert res.get(timeout=60)["tag"] == "outage"
        assert len(events.starts("outage")) == 1
        check_deliveries(events, rabbit, queue_type, "lock Redis down")
    finally:
        discard(w)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task_name", ["t.throttle_brief", "t.rate_brief"])
def test_a_window_reopening_in_under_a_second_is_waited_for_on_quorum_queues(
        rabbit: RabbitNode, redis_server: RedisServer, events: Any, task_name: str) -> None:
    """A throttle window of 0.8 s, and a rate of one start per 0.8 s, under
    ``retry``: a call that finds the window open is sent again for when it
    reopens, always in under a second. On quorum queues such a wait used to
    fail the call (``ValueError: countdown must be a positive number``, from
    native delayed delivery); every call runs, one per window."""
    queue = f"qwin-{uuid.uuid4().hex[:6]}"
    conf = broker_conf(rabbit.url(), "quorum")
    w = Worker(redis_server.url(), queue, concurrency=2, conf=conf)
    if task_name == "t.rate_brief":  # the rate tasks' app (their ACL needs more)
        w.cmd[w.cmd.index("tests.workerapp:app")] = "tests.rateapp:app"
    w.start()
    try:
        app = make_rate_app(redis_server.url(), queue, conf=conf)
        task = app.tasks[task_name]
        key = uuid.uuid4().hex[:10]
        sent = [task.delay(key, 0.0, f"win-{i}") for i in range(4)]
        for i, res in enumerate(sent):
            assert res.get(timeout=60)["tag"] == f"win-{i}", res.state
        assert sorted(e["tag"] for e in events.starts("win-")) == [f"win-{i}" for i in range(4)]
        # the case at hand came up: calls found the window open and waited
        assert [e for e in received(events) if e["waits"]], received(events)
        assert "countdown must be a positive number" not in w.logs()
        check_deliveries(events, rabbit, "quorum", f"{task_name} windows")
    finally:
        discard(w)
