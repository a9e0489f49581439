"""The bad day, on real workers: a killed pool child, a Redis outage.

Short forms run in the default suite. ``SLT_CHAOS_ROUNDS=N`` (or
``python -m pytest tests/worker/test_chaos.py --chaos-long`` via the env var) repeats
the fork race N times per broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import is_skipped
from tests.support import RedisServer, Worker, discard, missing, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

AMQP_URL = os.environ.get("SLT_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
ROUNDS = int(os.environ.get("SLT_CHAOS_ROUNDS", "1"))


def amqp_reachable() -> bool:
    host_port = AMQP_URL.split("@", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port or 5672)), timeout=2):
            return True
    except OSError:
        return False


def broker_conf(broker: str) -> dict[str, Any]:
    conf: dict[str, Any] = {"singleton_ttl": 30.0}
    if broker == "amqp":
        if not amqp_reachable():
            missing(f"no RabbitMQ at {AMQP_URL} (set SLT_AMQP_URL)")
        conf["broker_url"] = AMQP_URL
    return conf


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_a_task_sent_right_after_a_child_is_killed_runs_on_its_replacement(
        redis_server: RedisServer, events: Any, broker: str) -> None:
    """kill -9 of the only pool child mid-task, then a new task 0.3 s later: the
    replacement child runs it (it once inherited a mutex held by the main
    process's reaper thread and hung for ever). A fresh worker per round: the
    race is with the main process's first reap."""
    conf = broker_conf(broker)
    for round_ in range(ROUNDS):
        queue = f"fork-{broker}-{uuid.uuid4().hex[:8]}"
        worker = Worker(redis_server.url(), queue, concurrency=1, conf=conf).start()
        try:
            app = make_app(redis_server.url(), queue, conf=conf)
            key = uuid.uuid4().hex[:10]
            tag = f"victim-{round_}"
            app.tasks["t.hold"].delay(key, 30.0, tag)
            pid = wait_for(lambda tag=tag: events.starts(tag), 15, what="victim start")[0]["pid"]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda pid=pid: not _alive(pid), 5, what="child gone")
            # 0.3 s after the kill, while the pool forks the replacement
            time.sleep(0.3)
            nxt = app.tasks["t.hold"].delay(uuid.uuid4().hex[:10], 0.0, f"next-{round_}")
            assert nxt.get(timeout=30)["tag"] == f"next-{round_}"
            # and the victim's key was freed by the main process, well within its 30 s lease
            freed = app.tasks["t.hold"].delay(key, 0.0, f"after-{round_}")
            try:
                done = freed.get(timeout=30)
            except Exception as exc:
                raise AssertionError(f"{freed.id} did not end ({exc!r}); the worker's "
                                     f"log:\n{worker.logs()[-8000:]}") from None
            assert done["tag"] == f"after-{round_}", done
        finally:
            discard(worker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def outage_worker(redis_server: RedisServer, own_redis: RedisServer) -> Iterator[Any]:
    conf = {"singleton_on_backend_error": "retry"}
    w = Worker(redis_server.url(), f"outage-{uuid.uuid4().hex[:6]}", concurrency=2, conf=conf,
               lock_url=own_redis.url(2)).start()
    yield w, make_app(redis_server.url(), w.queue, lock_url=own_redis.url(2), conf=conf)
    discard(w)


def test_a_worker_comes_back_by_itself_after_a_long_redis_outage(
        outage_worker: Any, own_redis: RedisServer, events: Any) -> None:
    """The lock Redis is down while tasks keep arriving and retrying (hundreds of
    failed attempts, past the 100 connections a leak used to exhaust); once it is
    back, every task sent before and after runs, and each process holds a
    bounded number of connections to it."""
    worker, app = outage_worker
    own_redis.stop()
    early = [app.tasks["t.hold"].delay(uuid.uuid4().hex[:8], 0.0, f"early{i}") for i in range(20)]
    wait_for(lambda: worker.logs().count("Lock backend unavailable") >= 250, 120,
             what="250 failed lock attempts")
    assert not events.starts("early"), "ran without its lock"
    own_redis.start()
    late = [app.tasks["t.hold"].delay(uuid.uuid4().hex[:8], 0.0, f"late{i}") for i in range(20)]
    for res in early + late:
        assert res.get(timeout=60)["token"] > 0
    clients = own_redis.client().client_list()
    # main process + 2 children; each holds at most a few (see docs: bound per process)
    assert len(clients) - 1 <= 3 * 4, clients


# -- Redis restarted empty, Redis down past the lease, a paused network path ----------

def two_sided(redis_server: RedisServer, lock_url: str, conf: dict[str, Any],
              prefix: str) -> tuple[Worker, Any]:
    w = Worker(redis_server.url(), f"{prefix}-{uuid.uuid4().hex[:6]}", concurrency=2,
               conf=conf, lock_url=lock_url).start()
    return w, make_app(redis_server.url(), w.queue, lock_url=lock_url, conf=conf)


def test_redis_restarted_empty_mid_task_the_holder_takes_its_lock_back(
        redis_server: RedisServer, own_redis: RedisServer, events: Any) -> None:
    """Redis forgets every lock when it restarts empty. The holder's renewer sees
    the server go and writes its lock back as soon as Redis answers (its regular
    round is 10 s away): a duplicate sent once Redis is back is skipped."""
    worker, app = two_sided(redis_server, own_redis.url(2), {"singleton_ttl": 30.0}, "restart")
    try:
        t = app.tasks["t.hold"]
        key = uuid.uuid4().hex[:8]
        # it runs until told (below): it must outlast the restart and the
        # write-back however slow a loaded machine makes them
        holder = t.delay(key, 120.0, "holder")
        wait_for(lambda: events.starts("holder"), 15, what="holder start")
        lock_key = t.singleton_keys(key).lock
        own_redis.stop()
        own_redis.start()
        back = time.monotonic()
        client = own_redis.client(2)
        wait_for(lambda: client.exists(lock_key), 20, what="the lock written back")
        window = time.monotonic() - back
        dup = t.delay(key, 0.0, "dup").get(timeout=20)
        assert is_skipped(dup) and dup["holder"] == holder.id
        events.client.set(f"finish:{key}", 1)  # the holder ends now
        assert holder.get(timeout=20)["lost"] is False
        assert "Took back singleton lock" in worker.logs()
        print(f"\nlock written back {window * 1000:.0f} ms after Redis answered again")
    finally:
        discard(worker)


def test_redis_down_longer_than_the_lease_then_back(
        redis_server: RedisServer, own_redis: RedisServer, events: Any) -> None:
    """The holder cannot renew and learns it lost the lock; tasks sent meanwhile
    wait (never run unlocked); once Redis is back every task reaches a final
    state and the worker serves on, without a restart."""
    worker, app = two_sided(redis_server, own_redis.url(2), {}, "down")  # 2 s lease
    try:
        t = app.tasks["t.hold"]
        holder = t.delay(uuid.uuid4().hex[:8], 4.0, "holder")
        wait_for(lambda: events.starts("holder"), 15, what="holder start")
        own_redis.stop()
        waiting = [t.delay(uuid.uuid4().hex[:8], 0.0, f"w{i}") for i in range(5)]
        assert holder.get(timeout=30)["lost"] is True
        assert not events.starts("w")
        own_redis.start()
        assert all(r.get(timeout=60)["token"] > 0 for r in waiting)
        assert t.delay(uuid.uuid4().hex[:8], 0.0, "after").get(timeout=20)["tag"] == "after"
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        discard(worker)


def test_a_paused_network_path_longer_than_the_lease(
        redis_server: RedisServer, own_redis: RedisServer, events: Any) -> None:
    """Worker A reaches the lock Redis through a path that stops forwarding for
    longer than the lease; worker B, on a direct path, runs the duplicate with a
    higher token; A's holder knows it lost the lock; once the path resumes, A
    serves on."""
    from tests.support import PausableProxy

    proxy = PausableProxy(own_redis.port)
    a, app_a = two_sided(redis_server, proxy.url(2), {}, "path-a")
    b, app_b = two_sided(redis_server, own_redis.url(2), {}, "path-b")
    try:
        key = uuid.uuid4().hex[:8]
        stale = app_a.tasks["t.fenced"].delay(key, 5.0, "stale")
        wait_for(lambda: events.starts("stale"), 15, what="holder start")
        lock_key = app_a.tasks["t.fenced"].singleton_keys(key).lock
        proxy.pause()
        wait_for(lambda: not own_redis.client(2).exists(lock_key), 10, what="the lease to lapse")
        fresh = app_b.tasks["t.fenced"].delay(key, 0.0, "fresh").get(timeout=20)
        assert fresh["lost"] is False and fresh["check"] == "ok"
        proxy.resume()
        old = stale.get(timeout=30)
        assert old["lost"] is True and old["check"] == "LockLostError"
        assert old["token"] < fresh["token"]
        after = app_a.tasks["t.hold"].delay(uuid.uuid4().hex[:8], 0.0, "a-after")
        assert after.get(timeout=30)["tag"] == "a-after"
    finally:
        proxy.resume()
        discard(a)
        discard(b)
        proxy.close()


def test_a_whole_worker_stopped_past_the_lease_with_a_duplicate_waiting(
        redis_server: RedisServer, events: Any) -> None:
    """SIGSTOP of a whole worker (main process and child) whose task holds the
    key, a duplicate waiting on another worker (policy retry): the duplicate runs
    with a higher token once the lease lapses; after SIGCONT the stale holder
    sees it lost the lock, and its worker serves on."""
    a = Worker(redis_server.url(), f"stop-a-{uuid.uuid4().hex[:6]}", concurrency=1).start()
    b = Worker(redis_server.url(), f"stop-b-{uuid.uuid4().hex[:6]}", concurrency=1).start()
    try:
        app_a, app_b = make_app(redis_server.url(), a.queue), make_app(redis_server.url(), b.queue)
        key = uuid.uuid4().hex[:8]
        stale = app_a.tasks["t.hold_retry"].delay(key, 6.0, "stale")
        wait_for(lambda: events.starts("stale"), 15, what="holder start")
        dup = app_b.tasks["t.hold_retry"].delay(key, 0.0, "dup")
        os.killpg(a.pid, signal.SIGSTOP)
        try:
            out = dup.get(timeout=30)
        finally:
            os.killpg(a.pid, signal.SIGCONT)
        assert out["tag"] == "dup" and out["token"] > events.starts("stale")[0]["token"]
        assert stale.get(timeout=30)["lost"] is True
        assert app_a.tasks["t.hold"].delay(key, 0.0, "a-after").get(timeout=30)["tag"] == "a-after"
    finally:
        discard(a)
        discard(b)


def test_rabbitmq_acks_late_child_killed_redelivers_once_and_frees_the_key(
        redis_server: RedisServer, events: Any) -> None:
    """RabbitMQ as broker, Redis only for locks: an acks_late task whose child is
    killed is redelivered with the same id and runs once more (not skipped as a
    duplicate of its dead self), its key is freed, and a task sent right after
    the kill runs on the new child."""
    conf = broker_conf("amqp")
    w = Worker(redis_server.url(), f"late-amqp-{uuid.uuid4().hex[:6]}", concurrency=1,
               conf=conf).start()
    try:
        app = make_app(redis_server.url(), w.queue, conf=conf)
        key = uuid.uuid4().hex[:8]
        res = app.tasks["t.hold_late"].delay(key, 3.0, "late")
        pid = wait_for(lambda: events.starts("late"), 15, what="start")[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        nxt = app.tasks["t.hold"].delay(uuid.uuid4().hex[:8], 0.0, "next")
        assert res.get(timeout=60)["tag"] == "late"
        assert nxt.get(timeout=60)["tag"] == "next"
        runs = [e for e in events.starts("late") if e["id"] == res.id]
        assert len(runs) == 2 and runs[1]["token"] > runs[0]["token"]
        assert not redis_server.client(2).exists(app.tasks["t.hold_late"].singleton_keys(key).lock)
    finally:
        discard(w)


# -- the soak --------------------------------------------------------------------------

SOAK_SECONDS = float(os.environ.get("SLT_SOAK_SECONDS", "8"))
KILL_EVERY = float(os.environ.get("SLT_SOAK_KILL_EVERY", "2"))


def overlaps(events_list: list[dict[str, Any]], killed_at: dict[int, float]) -> list[Any]:
    """Pairs of executions of one key whose [start, end] intersect; a killed
    execution ends when its process was killed."""
    spans: dict[str, list[tuple[float, float, str]]] = {}
    ends = {e["id"] + str(e["pid"]): e["t"] for e in events_list if e["ev"] == "end"}
    for e in events_list:
        if e["ev"] == "start":
            end = ends.get(e["id"] + str(e["pid"]), killed_at.get(e["pid"], float("inf")))
            spans.setdefault(e["key"], []).append((e["t"], end, e["id"]))
    found = []
    for key, runs in spans.items():
        runs.sort()
        latest_end, latest_id = float("-inf"), ""
        for start, end, task_id in runs:
            if start < latest_end:
                found.append((key, latest_id, task_id, latest_end - start))
            if end > latest_end:
                latest_end, latest_id = end, task_id
    return found


@pytest.mark.long
@pytest.mark.timeout(SOAK_SECONDS + 240)
def test_soak_duplicate_storms_killed_children_and_a_worker_restart(
        redis_server: RedisServer, events: Any) -> None:
    """Two workers, duplicate storms over 20 keys with random durations, a child
    killed every few seconds and a whole worker restarted once: no two
    executions of a key overlap, every task sent reaches a final state (but a
    job Celery's pool lost with a killed process before it began), only
    fencing counters stay in Redis, the surviving worker's memory stays flat.
    ``SLT_SOAK_SECONDS=300 SLT_SOAK_KILL_EVERY=30`` is the long form."""
    import random

    queue = f"soak-{uuid.uuid4().hex[:6]}"
    # a worker whose warm shutdown is cut short by kill -9 leaves its prefetched
    # messages unacked: the broker hands them out again after this, not an hour
    conf = {"singleton_ttl": 2.0, "broker_transport_options": {"visibility_timeout": 20}}
    workers = [Worker(redis_server.url(), queue, concurrency=2, conf=conf).start()
               for _ in range(2)]
    app = make_app(redis_server.url(), queue, conf=conf)
    t = app.tasks["t.hold"]
    keys = [f"soak-{uuid.uuid4().hex[:6]}-{i}" for i in range(20)]
    sent: list[Any] = []
    killed_at: dict[int, float] = {}
    rng = random.Random(7)
    try:
        rss_start = _rss(workers[0].pid)
        started = last_kill = time.monotonic()
        restarted = False
        while time.monotonic() - started < SOAK_SECONDS:
            key = rng.choice(keys)
            sent += [t.delay(key, rng.uniform(0.0, 0.4), "soak") for _ in range(3)]
            if time.monotonic() - last_kill > KILL_EVERY:
                last_kill = time.monotonic()
                children = [p for w in workers for p in w.children()]
                if children:
                    victim = rng.choice(children)
                    # an execution there ended when its process was first killed
                    killed_at.setdefault(victim, time.time())
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
            if not restarted and time.monotonic() - started > SOAK_SECONDS / 2:
                restarted = True
                workers[1].stop(timeout=60)
                workers[1] = Worker(redis_server.url(), queue, concurrency=2, conf=conf).start()
            time.sleep(0.05)
        lost_by_the_pool = []
        for res in sent:
            with contextlib.suppress(Exception):  # a killed child's task fails: final too
                res.get(timeout=120, propagate=False)
            if res.state not in ("SUCCESS", "FAILURE"):
                # Celery's, not ours: a job handed to a pool process killed
                # before it took the job up is neither run nor failed, and
                # without acks_late its message is gone. Such a task was only
                # ever received: nothing of ours decided anything about it.
                seen = [line for w in workers for line in w.logs().splitlines()
                        if res.id in line]
                assert len(seen) == 1 and "received" in seen[0], (res.id, res.state, seen)
                lost_by_the_pool.append(res.id)
        assert len(lost_by_the_pool) <= len(killed_at), (lost_by_the_pool, killed_at)
        evs = events.all()
        assert overlaps(evs, killed_at) == []
        locks = redis_server.client(2)
        ours = [f"{t.singleton_keys(k).base}:*" for k in keys]
        left = lambda: [x for pattern in ours for x in locks.scan_iter(pattern)]  # noqa: E731
        wait_for(lambda: left() and all(x.endswith(":fence") for x in left()), 10,
                 what="only fencing counters left")
        growth = _rss(workers[0].pid) - rss_start
        print(f"\nsoak: {len(sent)} tasks, {len(killed_at)} children killed, "
              f"{sum(1 for e in evs if e['ev'] == 'start')} executions, "
              f"main process RSS growth {growth / 1024:.0f} KiB, "
              f"{len(lost_by_the_pool)} lost by the pool")
        assert growth < 30 * 1024 * 1024
    finally:
        for w in workers:
            discard(w)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- what the worker says at start -------------------------------------------------------

def start_and_wait(redis_server: RedisServer, lock_url: str) -> tuple[int, str, str]:
    """A worker started against ``lock_url``: its exit code (0 if still running
    once ready), its output and its log."""
    w = Worker(redis_server.url(), f"start-{uuid.uuid4().hex[:6]}", concurrency=1,
               lock_url=lock_url)
    w.start(wait=False)
    assert w.proc is not None
    try:
        wait_for(lambda: w.proc.poll() is not None or "ready." in w.logs(), 30,
                 what="the worker to start or stop")
        code = w.proc.poll()
        return (code or 0), w.output(), w.logs()
    finally:
        w.stop()


def test_a_worker_with_a_wrong_lock_password_stops_at_start_naming_it(redis_server):
    server = RedisServer(extra_args=["--requirepass", "right"]).start()
    try:
        code, output, _ = start_and_wait(
            redis_server, f"redis://:bad-pw-123@127.0.0.1:{server.port}/2")
        assert code != 0
        assert "celery-singleton-lock configuration error: singleton_redis_url:" in output
        assert "password" in output.lower() and "bad-pw-123" not in output
    finally:
        server.cleanup()


def test_a_worker_whose_acl_user_lacks_a_command_stops_at_start_naming_it(redis_server):
    from celery_singleton_lock.checks import doctor as checks

    server = RedisServer().start()
    try:
        server.client().execute_command("ACL", "SETUSER", "locks", "on", ">pw",
                                        *checks.acl_rule("singleton:", 2).split())
        server.client().execute_command("ACL", "SETUSER", "locks", "-get")
        code, output, _ = start_and_wait(redis_server,
                                         f"redis://locks:pw@127.0.0.1:{server.port}/2")
        assert code != 0
        assert "celery-singleton-lock configuration error" in output
        assert "may not run get" in output.lower() or "+get" in output.lower()
    finally:
        server.cleanup()


def test_a_worker_on_an_evicting_redis_warns_at_start(redis_server):
    server = RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]).start()
    try:
        code, _, log = start_and_wait(redis_server, server.url(2))
        assert code == 0
        assert "allkeys-lru" in log and "noeviction" in log
    finally:
        server.cleanup()


def test_a_worker_whose_lock_redis_is_down_says_so_and_starts(redis_server):
    server = RedisServer(extra_args=["--requirepass", "secret-pw"])  # never started
    code, _, log = start_and_wait(redis_server, server.url(2))
    assert code == 0
    assert "ready." in log and f"127.0.0.1:{server.port}" in log
    assert "secret-pw" not in log
    server.cleanup()
