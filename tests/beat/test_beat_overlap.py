"""Beat overlap modes past skip and buffer_one: buffer_all, cancel_other,
terminate_other. Real `celery beat` processes, a real prefork worker, real Redis;
what ran is read from the events the tasks record, never from a beat's belief.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
import uuid
from collections import Counter
from typing import Any

import pytest

import tests.beat.test_beat as beat_tests
from celery_singleton_lock.beat.ticks import claim_key, queue_key
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.worker.ticks import from_ms, tick_name
from tests.beat.test_beat import Beat, stats, tick_events, virtual_look
from tests.support import wait_for

pytestmark = pytest.mark.worker

# the fixtures of tests/beat/test_beat.py: a module worker of tests.beatapp, beats
# stopped after each test, the beats' counters emptied before it
beat_worker = beat_tests.beat_worker
beats = beat_tests.beats
clean_stats = beat_tests.clean_stats


def parse(tick: str) -> dt.datetime:
    return dt.datetime.fromisoformat(tick)


def counted(events: Any) -> Counter[str]:
    total = Counter[str]()
    for st in stats(events).values():
        total.update({k: int(v) for k, v in st.items() if k != "beat_id"})
    return total


def test_buffer_all_runs_each_overlapping_tick_in_order_one_at_a_time_and_survives_kill_9(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """A 3 s SingletonTask every second, buffer_all, cap 3, two beats: the ticks
    that come while a run runs wait in Redis and run one after another, each
    after the one before ended, in tick order, each once; past the cap a tick
    is dropped and counted. kill -9 of the beat that buffered the newest
    waiting tick: the other beat sends every tick that was waiting. The beats
    run as a lock Redis user with the worker's ACL rule and what
    docs/redis-acl.md adds for buffer_all (no EVAL: its scripts go by SHA)."""
    from celery_singleton_lock.checks.doctor import acl_rule

    key = uuid.uuid4().hex[:8]
    sched = {"all": {"task": "t.tick_hold", "every": 1,
                     "kwargs": {"key": key, "seconds": 3.0},
                     "options": {"singleton_overlap": "buffer_all"}}}
    conf = {"singleton_beat_buffer_max": 3}
    user = f"beat{uuid.uuid4().hex[:6]}"
    redis_server.client().execute_command(
        "ACL", "SETUSER", user, "on", ">pw", *acl_rule("singleton:", 2).split(),
        "+exists", "+zadd", "+zcard", "+zpopmin", "+zscore")
    lock_url = f"redis://{user}:pw@127.0.0.1:{redis_server.port}/2"
    try:
        _buffer_all_kill_9(redis_server, beat_worker, beats, events, r, sched, conf, lock_url)
    finally:
        redis_server.client().execute_command("ACL", "DELUSER", user)
    logs = "".join(b.logs() for b in beats)
    assert "may not run" not in logs and "Redis refused it" not in logs, logs


def _buffer_all_kill_9(redis_server, beat_worker, beats, events, r, sched, conf,
                       lock_url) -> None:
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          conf=conf, lock_url=lock_url).start())
    queue = queue_key("singleton:", "all")
    wait_for(lambda: r.zcard(queue) >= 3, 40, what="the queue full (3 ticks waiting)")
    wait_for(lambda: counted(events)["buffer_dropped"] >= 1, 20,
             what="a tick dropped past the cap")
    waiting = wait_for(lambda: r.zrange(queue, 0, -1) if r.zcard(queue) >= 2 else None, 20,
                       what="ticks waiting")
    newest = from_ms(int(waiting[-1]))
    buffering = r.get(claim_key("singleton:", "all", newest))  # who claimed it queued it
    victim = next(b for b in beats if b.proc is not None
                  and b.proc.pid == int(buffering.split(":")[1]))
    victim.kill()
    survivor = next(b for b in beats if b is not victim)
    names = [tick_name(from_ms(int(ms))) for ms in waiting]

    def ran() -> set[str]:
        return {e["singleton_beat_tick"] for e in tick_events(events, "all", "start")}

    wait_for(lambda: set(names) <= ran(), 60, what="every waiting tick to run after kill -9")
    for beat in beats:
        beat.stop()
    wait_for(lambda: len(tick_events(events, "all", "end")) == len(
        tick_events(events, "all", "start")), 15, what="the last run to end")

    starts = sorted(tick_events(events, "all", "start"), key=lambda e: e["at"])
    ends = {e["id"]: e["at"] for e in tick_events(events, "all", "end")}
    ticks = [e["singleton_beat_tick"] for e in starts]
    assert len(ticks) >= len(names) + 1  # a first run, then at least those that waited
    assert ticks == sorted(ticks), "run in tick order"
    assert len(set(ticks)) == len(ticks), "each tick once"
    assert all(e["concurrent"] == 1 for e in starts), "never two at once"
    for before, after in zip(starts, starts[1:]):
        assert ends[before["id"]] <= after["at"], (before, after)
    # the ticks after the first ran because they waited: their nominal time
    # fell while the run before them still ran
    assert sum(parse(e["singleton_beat_tick"]).timestamp() < ends[b["id"]]
               for b, e in zip(starts, starts[1:])) >= len(names)
    sent_by = {e["singleton_beat_tick"]: e["singleton_beat_id"] for e in starts}
    assert all(sent_by[n] != buffering for n in names[1:])
    assert sent_by[names[-1]].split(":")[1] == str(survivor.proc.pid)  # type: ignore[union-attr]
    c = counted(events)
    assert c["buffered"] >= 3 and c["buffer_dropped"] >= 1
    logs = "".join(b.logs() for b in beats)
    assert "dropped: 3 ticks already wait" in logs and "sent from the buffer" in survivor.logs()


def _stops_the_previous_run(redis_server, beat_worker, beats, events, mode: str
                            ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A 30 s run every 3 s under ``mode``, two beats: the run after the first.
    Returns (the first run's start, the second's, every event of the entry)."""
    key = uuid.uuid4().hex[:8]
    sched = {mode: {"task": "t.tick_cancellable", "every": 3,
                    "kwargs": {"key": key, "seconds": 30.0},
                    "options": {"singleton_overlap": mode}}}
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name).start())
    starts = wait_for(lambda: (s := tick_events(events, mode, "start"))[1:] and s, 40,
                      what="a second run")
    first, second = sorted(starts, key=lambda e: e["at"])[:2]
    wait_for(lambda: [e for e in tick_events(events, mode, "end") if e["id"] == first["id"]],
             10, what="the first run's end")
    for beat in beats:
        beat.stop()
    every = [e for e in events.all() if e.get("singleton_beat_entry") == mode]
    return first, second, every


def _ended_before_the_next(first: dict[str, Any], second: dict[str, Any],
                           every: list[dict[str, Any]]) -> None:
    first_end = next(e for e in every if e["id"] == first["id"] and e["ev"] == "end")
    assert not [e for e in every if e["id"] == first["id"] and e["ev"] == "finished"]
    assert first_end["at"] <= second["at"], "the next run started after the first ended"
    assert first_end["at"] - first["at"] < 15, "stopped long before its 30 s"
    assert all(e["concurrent"] == 1 for e in every if e["ev"] == "start")
    # the run after it is the tick that came while it ran, sent once its key freed
    gap = (parse(second["singleton_beat_tick"]) - parse(first["singleton_beat_tick"]))
    assert gap == dt.timedelta(seconds=3)
    assert parse(second["singleton_beat_tick"]).timestamp() < first_end["at"]
    assert Counter(e["singleton_beat_tick"] for e in every if e["ev"] == "start").most_common(
        1)[0][1] == 1


def test_terminate_other_terminates_the_running_task_then_sends_the_tick(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """terminate_other: the tick that comes while a 30 s run runs revokes it with
    terminate=True (SIGTERM to its pool process); its lock frees and the tick
    runs after it, never beside it. The first run never finished."""
    first, second, every = _stops_the_previous_run(
        redis_server, beat_worker, beats, events, "terminate_other")
    _ended_before_the_next(first, second, every)
    assert not [e for e in every if e["id"] == first["id"] and e["ev"] == "cancelled"]
    assert counted(events)["overlap_terminated"] >= 1
    logs = "".join(b.logs() for b in beats)
    assert f"the previous run {first['id']} still runs, terminated" in logs


def test_cancel_other_asks_the_running_task_to_stop_then_sends_the_tick(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """cancel_other: the tick that comes while a 30 s run runs asks it to stop;
    the body sees cancel_requested(self), returns, its lock frees and the tick
    runs after it, never beside it."""
    first, second, every = _stops_the_previous_run(
        redis_server, beat_worker, beats, events, "cancel_other")
    _ended_before_the_next(first, second, every)
    assert [e for e in every if e["id"] == first["id"] and e["ev"] == "cancelled"]
    # the process was asked, not killed: it recorded its own end and lived on
    assert counted(events)["overlap_cancelled"] >= 1
    logs = "".join(b.logs() for b in beats)
    assert f"the previous run {first['id']} still runs, asked to cancel" in logs


def test_a_tick_run_marker_appears_only_once_its_run_holds_the_lock(
        redis_server, beat_worker, events, r):
    """buffer_all sends the next tick when the last one's run marker exists and,
    read after it, the lock is free. So the worker writes the marker once the
    tick's lock is granted: a copy of a tick waiting for the lock (a run held
    it; singleton_on_duplicate "retry") has no marker yet, or a beat could read
    "ended" while that tick has not even started. A tick refused for good
    (skip) writes it: decided. A second copy of a tick that ran is dropped
    before it asks for the lock."""
    from celery_singleton_lock.engine.registry import engine_for
    from celery_singleton_lock.worker.ticks import run_key
    from tests.beatapp import make_beat_app

    key = uuid.uuid4().hex[:8]
    app = make_beat_app(redis_server.url(), beat_worker.queue)
    engine = engine_for(app)
    keys = app.tasks["t.tick_wait"].singleton_keys(key)
    ticks = [dt.datetime(2030, 1, 1, 0, 0, s, tzinfo=dt.timezone.utc) for s in (1, 2)]

    def send(task: str, tick: dt.datetime) -> str:
        headers = {"singleton_beat_entry": "marked", "singleton_beat_tick": tick_name(tick)}
        return str(app.tasks[task].apply_async(kwargs={"key": key}, headers=headers).id)

    def waits(task_id: str) -> bool:
        return f"[{task_id}] waits" in beat_worker.logs()

    engine.acquire(keys, Request(task_id="earlier-run", exec_id="earlier-exec",
                                 lease=Lease.of_ms(60_000), hostname="test@host", retries=0,
                                 task_name="t.tick_wait"))
    waiting = send("t.tick_wait", ticks[0])
    wait_for(lambda: beat_worker.logs().count(f"[{waiting}] waits") >= 2, 30,
             what="the tick's copy refused twice while the lock is held")
    assert r.get(run_key("singleton:", "marked", ticks[0])) is None, (
        "a run marker while its tick waits for the lock")
    assert engine.release(keys, "earlier-exec", "earlier-run", finished=False)
    started = wait_for(lambda: [e for e in tick_events(events, "marked", "start")
                                if e["id"] == waiting], 30, what="the tick's run")
    assert started[0]["singleton_beat_tick"] == tick_name(ticks[0])
    assert r.get(run_key("singleton:", "marked", ticks[0])) == waiting

    # a second copy of that tick: dropped on the marker, the lock untouched
    # (taken here once the tick's run has ended and freed it)
    wait_for(lambda: not engine.owner(keys), 30, what="the tick's run to free the lock")
    other = engine.acquire(keys, Request(task_id="other-run", exec_id="other-exec",
                                         lease=Lease.of_ms(60_000), hostname="test@host",
                                         retries=0, task_name="t.tick_wait"))
    assert other.status is Acquire.GRANTED, other
    copy = send("t.tick_wait", ticks[0])
    wait_for(lambda: f"Dropped {copy} of beat entry 'marked'" in beat_worker.logs(), 30,
             what="the second copy dropped")
    assert not waits(copy)
    # named by the copy that took the tick (it may still run: not "ran")
    assert f"that tick was already taken by {waiting} (it started, or was refused for good)" \
        in beat_worker.logs()

    assert engine.release(keys, "other-exec", "other-run", finished=False)

    # refused for good (t.tick_hold skips a duplicate): the tick is decided
    held = app.tasks["t.tick_hold"].singleton_keys(key)
    engine.acquire(held, Request(task_id="held-run", exec_id="held-exec",
                                 lease=Lease.of_ms(60_000), hostname="test@host", retries=0,
                                 task_name="t.tick_hold"))
    skipped = send("t.tick_hold", ticks[1])
    wait_for(lambda: r.get(run_key("singleton:", "marked", ticks[1])), 30,
             what="the skipped tick's marker")
    assert r.get(run_key("singleton:", "marked", ticks[1])) == skipped
    assert not [e for e in tick_events(events, "marked", "start") if e["id"] == skipped]
    assert engine.release(held, "held-exec", "held-run", finished=False)


def test_a_beat_whose_lock_user_may_not_run_what_its_entries_need_stops_at_start_naming_it(
        redis_server, beat_worker, beats, events, r):
    """A beat whose lock Redis user has the worker's ACL rule only (docs/redis-acl.md)
    and a buffer_one entry would fail to look for and take waiting ticks at every
    tick: it stops at start, naming the commands and the grant. Granted them, a
    beat with the same user starts and its ticks run."""
    from celery_singleton_lock.checks.doctor import acl_rule

    admin = redis_server.client()
    user = f"beat{uuid.uuid4().hex[:6]}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", *acl_rule("singleton:", 2).split())
    lock_url = f"redis://{user}:pw@127.0.0.1:{redis_server.port}/2"
    key = uuid.uuid4().hex[:8]
    sched = {"one": {"task": "t.tick_hold", "every": 1, "kwargs": {"key": key, "seconds": 0.1},
                     "options": {"singleton_overlap": "buffer_one"}}}
    try:
        refused = Beat(redis_server.url(), beat_worker.queue, sched, name="acl",
                       lock_url=lock_url).start()
        beats.append(refused)
        assert refused.proc is not None
        assert refused.proc.wait(60) != 0, "the beat should not start"
        logs = refused.logs()
        assert f"the lock Redis user '{user}' may not run exists, getdel" in logs, logs
        assert f"grant it: ACL SETUSER {user} +exists +getdel" in logs, logs
        assert not r.keys("singleton:beat:*"), "no tick was claimed"

        admin.execute_command("ACL", "SETUSER", user, "+exists", "+getdel")
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name="acl2",
                          lock_url=lock_url).start())
        wait_for(lambda: tick_events(events, "one", "start"), 30, what="a tick of the beat to run")
        assert beats[-1].alive and "may not run" not in beats[-1].logs()
        # the rule changed under the running beat: a refusal, not an outage
        admin.execute_command("ACL", "SETUSER", user, "-set")
        wait_for(lambda: "not sent: Redis refused it" in beats[-1].logs(), 30,
                 what="a tick refused by the ACL, logged as refused")
        assert "Redis unreachable" not in beats[-1].logs()
        # ... and the look for a dead beat's buffered tick says so, once
        admin.execute_command("ACL", "SETUSER", user, "-exists")
        look = "could not look for the waiting ticks of other beats (Redis refused it"
        wait_for(lambda: look in beats[-1].logs(), 30, what="the refused look, logged")
        seen = beats[-1].logs().count("not sent: Redis refused it")
        wait_for(lambda: beats[-1].logs().count("not sent: Redis refused it") >= seen + 3, 30,
                 what="three more refused ticks")
        assert beats[-1].logs().count(look) == 1
        admin.execute_command("ACL", "SETUSER", user, "+exists")
        wait_for(lambda: "looks for the waiting ticks of other beats again" in beats[-1].logs(),
                 30, what="the look working again, logged")
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_buffer_all_keeps_order_one_at_a_time_when_worker_children_die(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """buffer_all, three beats, two workers, a 1.5 s run every second: the
    pool process running a tick is killed (-9) twice, and once the one that
    has just received a tick, before that copy reaches its lock. The buffer
    never stalls: the next waiting tick runs as soon as the lost one's lock is
    free (the worker's main process writes a lost copy's run marker, so the
    beats do not wait for it until ``...:last`` expires, 100 s); every tick
    runs in tick order, one at a time, each once, all but the one lost before
    its lock."""
    from tests.support import Worker, discard

    second = Worker(redis_server.url(), beat_worker.queue, concurrency=2)
    second.cmd[second.cmd.index("tests.workerapp:app")] = "tests.beatapp:app"
    second.start()
    try:
        _children_die_under_buffer_all(redis_server, beat_worker, beats, events, r,
                                       lambda: beat_worker.logs() + second.logs())
    finally:
        discard(second)


def _children_die_under_buffer_all(redis_server, beat_worker, beats, events, r,
                                   worker_logs) -> None:
    key = uuid.uuid4().hex[:8]
    sched = {"lossy": {"task": "t.tick_hold", "every": 1,
                       "kwargs": {"key": key, "seconds": 1.5},
                       "options": {"singleton_overlap": "buffer_all"}}}
    for name in ("a", "b", "c"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          conf={"singleton_beat_buffer_max": 30}).start())
    rec = events.client
    queue = queue_key("singleton:", "lossy")

    def runs(ev: str = "start") -> list[dict[str, Any]]:
        return sorted(tick_events(events, "lossy", ev), key=lambda e: e["at"])

    def running() -> dict[str, Any]:
        ended = {e["id"] for e in runs("end")}
        return wait_for(lambda: [e for e in runs() if e["id"] not in ended
                                 and e["id"] not in killed], 30, what="a run")[-1]

    killed: dict[str, float] = {}  # task id -> when its process was killed
    for _ in range(2):  # a run killed while it holds the lock, with ticks waiting
        wait_for(lambda: r.zcard(queue) >= 2, 30, what="ticks waiting")
        victim = running()
        os.kill(victim["pid"], signal.SIGKILL)
        killed[victim["id"]] = time.time()
        wait_for(lambda v=victim: [e for e in runs() if e["at"] > killed[v["id"]]], 30,
                 what="the next tick to run after the kill")

    # a copy killed after it received its tick, before it reached the lock
    wait_for(lambda: r.zcard(queue) >= 2, 30, what="ticks waiting")
    rec.set(f"prerun-hold:{key}", 1, ex=120)
    held = wait_for(lambda: [e for e in tick_events(events, "lossy", "prerun")], 30,
                    what="a copy held before its lock")[0]
    os.kill(held["pid"], signal.SIGKILL)
    killed[held["id"]] = time.time()
    rec.delete(f"prerun-hold:{key}")
    after = wait_for(lambda: [e for e in runs() if e["at"] > killed[held["id"]]], 30,
                     what="the next tick to run after the copy lost before its lock "
                          "(without its marker the beats wait until ...:last expires, 100 s)")
    wait_for(lambda: [e for e in runs() if e["at"] > after[0]["at"]], 30,
             what="one more tick after it")
    for beat in beats:
        beat.stop()
    wait_for(lambda: {e["id"] for e in runs("end")} | set(killed) >= {e["id"] for e in runs()},
             15, what="the last run to end")

    starts = runs()
    ends = {e["id"]: e["at"] for e in runs("end")}
    for task_id, at in killed.items():  # the figures docs/beat.md quotes (pytest -s)
        print(f"killed {'before its lock' if task_id == held['id'] else 'while running'}: "
              f"the next tick ran {min(e['at'] for e in starts if e['at'] > at) - at:.2f} s later")
    ticks = [parse(e["singleton_beat_tick"]) for e in starts]
    assert ticks == sorted(ticks), "run in tick order"
    assert len(set(ticks)) == len(ticks), "each tick once"
    for before, then in zip(starts, starts[1:]):  # one at a time
        assert ends.get(before["id"], killed.get(before["id"], 0)) <= then["at"], (before, then)
    # every tick from the first to the last ran, but the copy lost before its lock
    lost = parse(held["singleton_beat_tick"])
    assert lost not in ticks
    expected = [ticks[0] + dt.timedelta(seconds=n)
                for n in range(int((ticks[-1] - ticks[0]).total_seconds()) + 1)]
    assert sorted([*ticks, lost]) == expected
    assert sum(e["id"] in killed for e in starts) == 2
    assert f"its copy {held['id']} was lost before it took its lock" in worker_logs()


def test_a_beat_with_waiting_modes_looks_for_others_waiting_ticks_every_second(redis_server):
    """A beat whose entries' ticks may wait (buffer_one, buffer_all) wakes at
    least every BUFFER_ADOPT (1 s) to look for waiting ticks it does not hold
    (their beat may have died), however far its next tick is: not only at
    Celery's next tick (``beat_max_loop_interval``, 300 s by default). A beat
    without such entries sleeps as Celery says."""
    from celery_singleton_lock.beat.overlap import BUFFER_ADOPT
    from tests.beatapp import make_beat_app
    from tests.contract.promises import VirtualScheduler

    for mode, waits in (("buffer_one", True), ("buffer_all", True), ("skip", False)):
        app = make_beat_app(redis_server.url(), "unused", schedule={
            "hourly": {"task": "t.tick_hold", "every": 3600,
                       "kwargs": {"key": uuid.uuid4().hex},
                       "options": {"singleton_overlap": mode}}})
        beat = VirtualScheduler(app=app)
        waiting = beat.overlap.before_tick()
        assert waiting is waits, mode
        delay = beat.overlap.delay(300.0, waiting)
        assert (0.0 <= delay <= BUFFER_ADOPT) if waits else delay == 300.0, (mode, delay)


def test_skip_and_buffer_one_send_nothing_while_the_previous_run_holds_its_lock(
        redis_server):
    """On a virtual clock (every 10 s), the run's lock real: under ``skip`` a
    tick due while the previous run holds its task's lock is not sent (the
    worker would skip it as a duplicate; the beat does not send it) and is
    counted; under ``buffer_one`` it waits in Redis, is replaced by a newer
    one (one dropped, counted once) and is sent only once the run ended."""
    from celery_singleton_lock.engine.registry import engine_for
    from tests.beatapp import make_beat_app
    from tests.contract.promises import VirtualScheduler

    t0 = dt.datetime(2030, 1, 1, 0, 0, 0, tzinfo=dt.timezone.utc)
    for mode in ("skip", "buffer_one", "allow"):
        key, name = uuid.uuid4().hex, f"{mode}-{uuid.uuid4().hex[:8]}"
        app = make_beat_app(redis_server.url(), "unused", schedule={
            name: {"task": "t.tick_hold", "every": 10, "kwargs": {"key": key},
                   "options": {"singleton_overlap": mode}}})
        beat = VirtualScheduler(app=app)
        beat.sent = []

        def look(seconds: float, beat: Any = beat) -> list[dt.datetime]:
            return virtual_look(beat, t0, seconds)

        assert look(0.0) == [t0]
        engine = engine_for(app)
        keys = app.tasks["t.tick_hold"].singleton_keys(key=key)
        assert engine.acquire(keys, Request(task_id="run-0", exec_id="exec-0",
                                            lease=Lease.of_ms(60_000), hostname="w1@host",
                                            task_name="t.tick_hold")).token > 0
        ten, twenty = t0 + dt.timedelta(seconds=10), t0 + dt.timedelta(seconds=20)
        if mode == "allow":  # always sent: the task's own lock decides
            assert look(10.0) == [t0, ten] and look(20.0) == [t0, ten, twenty]
            assert (beat.singleton_stats["overlap_skipped"],
                    beat.singleton_stats["buffered"]) == (0, 0), beat.singleton_stats
            continue
        assert look(10.0) == [t0]
        assert look(15.0) == [t0]
        assert look(20.0) == [t0]
        stats_ = beat.singleton_stats
        if mode == "skip":
            assert stats_["overlap_skipped"] == 2 and stats_["buffered"] == 0, stats_
        else:
            assert stats_["overlap_skipped"] == 0, stats_
            assert stats_["buffered"] == 2 and stats_["buffer_dropped"] == 1, stats_
        assert engine.release(keys, "exec-0", "run-0") is True  # the run ends
        after = look(21.0)
        assert after == ([t0] if mode == "skip" else [t0, t0 + dt.timedelta(seconds=20)])


def test_a_claim_outlives_every_attempt_of_any_beat_on_its_tick():
    """docs/beat.md: a claim lives the catch-up window, the clock skew allowed
    between beats and 10 s (100 s with the defaults), so a beat whose clock is
    behind by up to the skew still finds the tick claimed."""
    from celery_singleton_lock.beat.scheduler import BeatConfig

    assert BeatConfig(60.0, "skip", "skip", 30.0).claim_ttl_ms == 100_000
    assert BeatConfig(20.0, "skip", "skip", 3.0).claim_ttl_ms == 33_000
