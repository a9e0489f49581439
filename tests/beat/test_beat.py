"""Beat without a leader: real `celery beat` processes, real workers, real Redis.

Each tick is counted by the headers it reaches the worker with
(``singleton_beat_entry``, ``singleton_beat_tick``), so "sent exactly once" is
read from what actually ran, not from what a beat believes it did.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import pytest
import redis
from celery.beat import Scheduler
from celery.schedules import crontab, schedule

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.beat.scheduler import BeatConfig, SingletonSchedulerMixin, beat_config
from celery_singleton_lock.beat.ticks import (
    buffer_key,
    claim_key,
    interval_ticks,
    late_key,
    ticks_around,
)
from celery_singleton_lock.config import get_config
from celery_singleton_lock.engine.registry import connect, engine_for
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.exceptions import ConfigurationError
from celery_singleton_lock.worker.ticks import claim_tick_run, entry_base, from_ms, tick_name, to_ms
from tests.contract import promises
from tests.support import ROOT, RedisServer, Worker, discard, wait_for

pytestmark = pytest.mark.worker

UTC = dt.timezone.utc


def at(*parts: int) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def parse(tick: str) -> dt.datetime:
    return dt.datetime.fromisoformat(tick)


# -- tick naming: no servers ------------------------------------------------------------


def test_interval_ticks_are_aligned_to_the_epoch_whatever_the_start():
    """Two beats started 0.4 s apart name the same ticks; stock Celery would not."""
    period = dt.timedelta(seconds=10)
    a = interval_ticks(period, at(2024, 5, 1, 12, 0, 3))
    b = interval_ticks(period, at(2024, 5, 1, 12, 0, 7, 400000))
    assert a == b == (at(2024, 5, 1, 12, 0, 0), at(2024, 5, 1, 12, 0, 10))
    # stock: due times count from each process's own last run, so they differ
    stock = schedule(period, nowfun=lambda: at(2024, 5, 1, 12, 0, 8))
    assert stock.remaining_estimate(at(2024, 5, 1, 12, 0, 3)) != stock.remaining_estimate(
        at(2024, 5, 1, 12, 0, 7, 400000))


def test_crontab_tick_is_the_latest_fire_time_not_after_now_in_utc():
    """A crontab tick is its nominal fire time (in UTC), never the moment the beat woke."""
    from celery import Celery

    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    daily = crontab(minute=0, hour=3, app=app)  # 03:00 Paris = 02:00 UTC in winter
    latest, nxt = ticks_around(daily, at(2024, 1, 10, 2, 0, 41), window=60)
    assert latest == at(2024, 1, 10, 2, 0)
    assert nxt == at(2024, 1, 11, 2, 0)
    every_minute = crontab(app=app)
    assert ticks_around(every_minute, at(2024, 1, 10, 9, 7, 0), 60)[0] == at(2024, 1, 10, 9, 7)
    assert ticks_around(every_minute, at(2024, 1, 10, 9, 7, 59, 999000), 60) == (
        at(2024, 1, 10, 9, 7), at(2024, 1, 10, 9, 8))


def test_only_the_latest_missed_tick_within_the_catchup_window_is_named():
    """After a downtime only the latest tick counts, and only inside the window."""
    from celery import Celery

    app = Celery(set_as_current=False)
    every_minute = crontab(app=app)
    # down since 09:00; it is 09:05:30: only 09:05 is due, 09:01..09:04 never are
    assert ticks_around(every_minute, at(2024, 1, 10, 9, 5, 30), 60)[0] == at(2024, 1, 10, 9, 5)
    hourly = crontab(minute=0, app=app)
    # 10:00 missed by 5 minutes: outside a 60 s window, not sent; next is 11:00
    assert ticks_around(hourly, at(2024, 1, 10, 10, 5), 60) == (None, at(2024, 1, 10, 11, 0))
    assert ticks_around(hourly, at(2024, 1, 10, 10, 5), 600)[0] == at(2024, 1, 10, 10, 0)
    slow = schedule(dt.timedelta(hours=1))
    assert ticks_around(slow, at(2024, 1, 10, 10, 0, 59), 60)[0] == at(2024, 1, 10, 10, 0)
    assert ticks_around(slow, at(2024, 1, 10, 10, 1, 1), 60)[0] is None


def test_beat_settings_are_checked_and_name_the_setting():
    from celery import Celery

    app = Celery(set_as_current=False)
    assert beat_config(app) == BeatConfig(catchup=60.0, on_backend_error="skip",
                                          overlap="skip", max_clock_skew=30.0, buffer_max=10)
    for name, bad in (("singleton_beat_catchup", -1), ("singleton_beat_on_backend_error", "run"),
                      ("singleton_beat_overlap", "buffer_some"),
                      ("singleton_beat_max_clock_skew", "5"), ("singleton_beat_buffer_max", 0)):
        app.conf[name] = bad
        with pytest.raises(ConfigurationError) as info:
            beat_config(app)
        assert info.value.setting == name
        app.conf[name] = None


def test_an_entry_without_an_overlap_option_has_the_settings_mode():
    """An entry's overlap mode is its own ``singleton_overlap`` option, else
    the app's ``singleton_beat_overlap`` (docs/beat.md: what a beat sends
    besides its claims, and which beat looks for dead beats' waiting ticks,
    follows from these modes); an entry whose task is no SingletonTask has
    none."""
    from celery import Celery

    from celery_singleton_lock import SingletonTask
    from celery_singleton_lock.beat.scheduler import overlap_modes

    app = Celery(set_as_current=False)
    app.conf.singleton_beat_overlap = "buffer_one"

    @app.task(base=SingletonTask, name="modes.t", shared=False)
    def t() -> None:
        return None

    @app.task(name="modes.plain", shared=False)
    def plain() -> None:
        return None

    assert overlap_modes(app, [("modes.t", None), ("modes.t", {})]) == ["buffer_one"]
    assert overlap_modes(app, [("modes.t", {"singleton_overlap": "allow"}),
                               ("modes.t", {"queue": "q"}),
                               ("modes.plain", {"singleton_overlap": "buffer_all"})]) == [
        "allow", "buffer_one"]


def test_two_beats_with_clocks_five_seconds_apart_send_each_tick_once(redis_server, r):
    promises.two_beats_with_skewed_clocks_send_each_tick_once(redis_server.url())


def test_worker_runs_a_tick_once_even_when_two_copies_were_sent(redis_server, r):
    """A tick sent twice (a claim lost in a failover) runs once; its own retry still runs.
    (``r`` empties the lock db first.)"""
    engine = connect(SingletonConfig.defaults(redis_server.url(2)))
    headers = {"singleton_beat_entry": "report",
               "singleton_beat_tick": "2030-01-01T00:00:00.000+00:00"}
    assert claim_tick_run(engine, "singleton:", {**headers, "id": "first"})
    assert claim_tick_run(engine, "singleton:", {**headers, "id": "first"})  # its retry/redelivery
    assert not claim_tick_run(engine, "singleton:", {**headers, "id": "second-copy"})
    assert claim_tick_run(engine, "singleton:", {"id": "not-from-beat"})
    assert claim_tick_run(engine, "singleton:", {**headers, "singleton_beat_tick":
                                                 "2030-01-01T00:00:01.000+00:00", "id": "next"})


def test_a_copy_of_a_tick_that_finds_its_run_taken_after_its_grant_frees_its_own_slot_only(
        redis_server, r, monkeypatch):
    """docs/beat.md (The worker refuses a second run of the same tick): two
    copies of one tick, another task id for a tick already taken is dropped
    (``Ignore``) and "the lock it was just granted is freed". Here the copy's
    look before its lock finds no marker: the other copy is granted and
    claims the tick's run between that look and this copy's own grant (the
    two ordered by a wrapper around the engine's ``acquire``; Redis and the
    task's run are real, as a worker runs it). With ``singleton_limit=2`` both
    are granted, slot 1 and slot 2: the late copy's body does not run, its
    slot is freed at once, and the other copy's slot stays the other copy's."""
    from celery import Celery
    from celery.exceptions import Ignore

    from celery_singleton_lock import SingletonTask
    from celery_singleton_lock.engine.registry import forget_engine
    from celery_singleton_lock.engine.replies import Acquire
    from celery_singleton_lock.worker.ticks import run_key

    app = Celery("tick-copies", broker="memory://", set_as_current=False)
    app.conf.singleton_redis_url = redis_server.url(2)
    ran: list[str] = []

    @app.task(base=SingletonTask, bind=True, name="t.copies", shared=False,
              singleton_key=("k",), singleton_limit=2)
    def copies(self: Any, k: str) -> None:
        ran.append(self.request.id)

    tick = "2030-01-01T00:00:00.000+00:00"
    headers = {"singleton_beat_entry": "report", "singleton_beat_tick": tick}
    marker = run_key("singleton:", "report", parse(tick))
    keys = copies.singleton_keys(k="report")
    engine = engine_for(app)
    real_acquire = engine.acquire
    between: list[Any] = []

    def acquire(lock_keys: Any, request: Request) -> Any:
        if request.task_id == "late-copy" and not between:
            # the late copy has looked (no marker yet) and asks for its lock:
            # the other copy is granted first and claims the tick's run, as
            # its own _run_keyed does
            between.append(r.get(marker))
            other = real_acquire(keys, Request(
                task_id="other-copy", exec_id="other-exec", lease=Lease.of_ms(60_000),
                hostname="w1@host", task_name="t.copies", slots=2))
            assert (other.status, other.slot) == (Acquire.GRANTED, 1)
            assert claim_tick_run(engine, "singleton:", {**headers, "id": "other-copy"})
        return real_acquire(lock_keys, request)

    monkeypatch.setattr(engine, "acquire", acquire)
    try:
        copies.push_request(id="late-copy", hostname="w2@host", retries=0, is_eager=False,
                            called_directly=False, args=(), kwargs={"k": "report"}, **headers)
        try:
            with pytest.raises(Ignore):
                copies(k="report")
        finally:
            copies.pop_request()
        engine.settle()  # the release's reply read: Redis has run it
        assert between == [None], "the late copy looked before the other copy's claim"
        assert ran == [], "the late copy's body ran"
        assert r.get(marker) == "other-copy"
        assert engine.owner(keys.slot(2)) == {}, "the late copy's slot was left held"
        assert engine.owner(keys.slot(1)).get("task") == "other-copy", (
            "the other copy's slot was freed from under it")
        assert engine.release(keys.slot(1), "other-exec", "other-copy") is True
    finally:
        monkeypatch.undo()
        forget_engine(app)
        engine.close()


# -- real beats -----------------------------------------------------------------------


class Beat:
    """`celery -A tests.beatapp beat -S tests.beatapp:RecordingScheduler`, its own schedule
    file (``app`` and ``scheduler`` name others; ``env`` adds to its environment)."""

    def __init__(self, redis_url: str, queue: str, schedule: dict[str, Any], *, name: str,
                 offset: float = 0.0, lock_url: Optional[str] = None,
                 conf: Optional[dict[str, Any]] = None, app: str = "tests.beatapp:app",
                 scheduler: str = "tests.beatapp:RecordingScheduler",
                 env: Optional[dict[str, str]] = None) -> None:
        self.name = name
        self.target = (app, scheduler)
        self.dir = Path(tempfile.mkdtemp(prefix=f"slt-beat-{name}-"))
        self.log = self.dir / "beat.log"
        self.env = dict(os.environ)
        self.env.update({
            "SLT_REDIS_URL": redis_url, "SLT_LOCK_URL": lock_url or "", "SLT_QUEUE": queue,
            "SLT_CONF": json.dumps(conf or {}), "SLT_BEAT_SCHEDULE": json.dumps(schedule),
            "SLT_CLOCK_OFFSET": str(offset), "SLT_BEAT_NAME": name,
            "PYTHONPATH": os.pathsep.join([str(ROOT), self.env.get("PYTHONPATH", "")]),
            **(env or {}),
        })
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> Beat:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", self.target[0], "beat",
             "-S", self.target[1], "-s", str(self.dir / "schedule"),
             "--pidfile=", "--loglevel", "INFO", "-f", str(self.log)],
            env=self.env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        return self

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9: no chance to clean anything up."""
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.kill()


@pytest.fixture(scope="module")
def beat_worker(redis_server: RedisServer) -> Iterator[Worker]:
    """A worker of tests.beatapp: runs t.tick and t.tick_hold for every beat of the module."""
    worker = Worker(redis_server.url(), f"beat-{uuid.uuid4().hex[:8]}", concurrency=4)
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.beatapp:app"
    worker.start()
    yield worker
    discard(worker)  # the module's tests are over: a run still running is killed


@pytest.fixture
def beats() -> Iterator[list[Beat]]:
    started: list[Beat] = []
    yield started
    for beat in started:
        beat.stop()


def tick_events(events: Any, entry: str, ev: str = "tick") -> list[dict[str, Any]]:
    return [e for e in events.all() if e.get("singleton_beat_entry") == entry and e["ev"] == ev]


def claims(r: Any, entry: str) -> dict[str, str]:
    """The ticks of an entry some beat claimed, each with its claimant's beat id,
    read from the claim keys themselves."""
    base = entry_base("singleton:", entry)
    out = {}
    for key in r.scan_iter(f"{base}:*"):
        last = key.rsplit(":", 1)[1]
        if ":run:" not in key and last.isdigit():
            ms = int(last)
            tick = dt.datetime.fromtimestamp(ms / 1000, UTC)
            out[tick.isoformat(timespec="milliseconds")] = r.get(key) or ""
    return out


def claimed(r: Any, entry: str) -> set[str]:
    """The ticks of an entry some beat claimed."""
    return set(claims(r, entry))


def every_claimed_tick_ran(r: Any, entry: str, ran: Callable[[], Iterable[str]],
                           timeout: float = 20.0) -> set[str]:
    """Waits until every tick of ``entry`` a beat claimed has run, once every
    beat was killed or stopped, but for the one loss docs/beat.md states (Known
    limits): a beat that dies or is stopped between its claim and its send
    loses that tick. Such a tick is its claimant's last claim of the entry, so
    at most one a beat. Returns those ticks (printed); fails naming every
    claimed tick that did not run, with its claimant, for any other loss."""
    def unrun() -> dict[str, str]:
        done = set(ran())
        return {t: who for t, who in claims(r, entry).items() if t not in done}

    try:
        wait_for(lambda: not unrun(), timeout, what="every claimed tick to run")
        return set()
    except AssertionError:
        missing = unrun()
    every = claims(r, entry)
    last_of = {who: max(t for t, w in every.items() if w == who) for who in every.values()}
    not_last = {t: who for t, who in missing.items() if last_of[who] != t}
    assert not not_last, (
        f"ticks of {entry!r} claimed and never run that were not their claimant's last "
        f"claim (a beat sends a claimed tick before it claims the next): {not_last}; "
        f"every claim: {sorted(every.items())}; runs: {sorted(ran())}")
    print(f"{entry!r}: lost between a claim and its send (a beat killed or stopped "
          f"there, docs/beat.md Known limits): {sorted(missing.items())}")
    return set(missing)


def stats(events: Any) -> dict[str, dict[str, str]]:
    client = events.client
    return {k.split(":", 1)[1]: client.hgetall(k) for k in client.scan_iter("beatstats:*")}


@pytest.fixture
def clean_stats(events: Any) -> None:
    for k in events.client.scan_iter("beatstats:*"):
        events.client.delete(k)


def test_three_beats_send_every_tick_exactly_once_and_survive_kill_9(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """Three beats (clocks up to 0.7 s apart), a 1 s interval and a crontab, 20+ s:
    every nominal tick ran exactly once; kill -9 of the beat sending the ticks
    leaves no gap; headers name the entry, the tick and the beat."""
    sched = {"every-second": {"task": "t.tick", "every": 1},
             "every-minute": {"task": "t.tick", "crontab": "*"}}
    for name, offset in (("a", 0.0), ("b", 0.35), ("c", -0.35)):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          offset=offset).start())

    def seconds() -> list[str]:
        return sorted({e["singleton_beat_tick"] for e in tick_events(events, "every-second")})

    wait_for(lambda: len(seconds()) >= 10, 40, what="10 ticks from three beats")
    last = max(tick_events(events, "every-second"), key=lambda e: e["singleton_beat_tick"])
    pid = int(last["singleton_beat_id"].split(":")[1])
    victim = next(b for b in beats if b.proc is not None and b.proc.pid == pid)
    victim.kill()
    killed_at = last["singleton_beat_tick"]
    wait_for(lambda: len([t for t in seconds() if t > killed_at]) >= 11, 40,
             what="10 ticks after kill -9 of the sending beat")
    for beat in beats:
        beat.stop()
    # every tick a beat claimed reaches the worker (but what a kill or a stop
    # between a claim and its send loses, at most one a beat)
    lost = every_claimed_tick_ran(r, "every-second", seconds)

    runs = tick_events(events, "every-second")
    counts = Counter(e["singleton_beat_tick"] for e in runs)
    assert set(counts.values()) == {1}, [t for t, n in counts.items() if n > 1]
    ticks = sorted(parse(t) for t in set(counts) | lost)
    gaps = [(b - a).total_seconds() for a, b in zip(ticks, ticks[1:])]
    assert gaps == [1.0] * len(gaps), gaps  # no tick unclaimed, kill -9 included
    assert (ticks[-1] - ticks[0]).total_seconds() >= 20
    after_kill = [e for e in runs if e["singleton_beat_tick"] > killed_at]
    assert after_kill and all(
        int(e["singleton_beat_id"].split(":")[1]) != pid for e in after_kill)
    for e in runs:
        assert e["periodic_task_name"] == "every-second" and e["celery_beat_task"] is True
        assert parse(e["singleton_beat_tick"]).microsecond == 0

    minutes = Counter(e["singleton_beat_tick"] for e in tick_events(events, "every-minute"))
    assert set(minutes.values()) <= {1}, minutes
    assert all(parse(t).second == 0 for t in minutes)
    for m in range(int(ticks[0].timestamp()) + 1, int(ticks[-1].timestamp())):
        if m % 60 == 0:  # a minute boundary inside the run: its crontab tick ran
            assert dt.datetime.fromtimestamp(m, UTC).isoformat(timespec="milliseconds") in minutes

    # claims: one hash tag per entry, each expiring on its own
    keys = list(r.scan_iter(f"{entry_base('singleton:', 'every-second')}:*"))
    assert keys and all(0 < r.pttl(k) <= BeatConfig(60, "skip", "skip", 30).claim_ttl_ms
                        for k in keys if ":run:" not in k)


def test_after_every_beat_was_down_one_comes_back_with_one_send_not_a_storm(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """All beats killed for 4+ ticks; the one restarted sends the latest tick only."""
    sched = {"catchup": {"task": "t.tick", "every": 1}}
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name).start())

    def seen() -> list[str]:
        return [e["singleton_beat_tick"] for e in tick_events(events, "catchup")]

    wait_for(lambda: len(seen()) >= 3, 30, what="3 ticks")
    for beat in beats:
        beat.kill()
    every_claimed_tick_ran(r, "catchup", seen)
    before = max(seen())
    wait_for(lambda: time.time() - parse(before).timestamp() > 4.5, 10, what="downtime")
    beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name="back").start())
    wait_for(lambda: len([t for t in seen() if t > before]) >= 3, 30,
             what="3 ticks after the restart")
    for beat in beats:
        beat.stop()

    counts = Counter(seen())
    assert set(counts.values()) == {1}, counts
    after = sorted(parse(t) for t in counts if t > before)
    missed = (after[0] - parse(before)).total_seconds()
    assert missed >= 4.0, "the beats were down for more than four ticks"
    # of the ticks nominally due while every beat was down, only the latest ran
    assert [t for t in counts if before < t < after[0].isoformat(timespec="milliseconds")] == []
    assert [(b - a).total_seconds() for a, b in zip(after, after[1:])] == [1.0] * (len(after) - 1)


@pytest.mark.parametrize("mode", ["skip", "buffer_one"])
def test_overlapping_ticks_of_a_long_singleton_task_are_skipped_or_buffered_and_counted(
        redis_server, beat_worker, beats, events, r, clean_stats, mode):
    """A 2.4 s SingletonTask every second: runs never overlap; every claimed tick
    either ran or was counted (overlap_skipped / buffer_dropped) and logged."""
    key = uuid.uuid4().hex[:8]
    sched = {"long": {"task": "t.tick_hold", "every": 1,
                      "kwargs": {"key": key, "seconds": 2.4},
                      "options": {"singleton_overlap": mode}}}
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name).start())
    wait_for(lambda: len(tick_events(events, "long", "end")) >= 3, 40, what="3 runs")
    for beat in beats:
        beat.stop()

    def counted() -> Counter[str]:
        total = Counter[str]()
        for st in stats(events).values():
            total.update({k: int(v) for k, v in st.items() if k != "beat_id"})
        return total

    def accounted() -> int:
        """Claimed ticks not yet run, skipped, or dropped from the buffer."""
        c = counted()
        return len(claimed(r, "long")) - len(tick_events(events, "long", "start")) - c[
            "overlap_skipped"] - c["buffer_dropped"]

    # A beat stopped between its claim and its send, or holding a buffered tick,
    # leaves that one tick unsent: at most one per beat.
    wait_for(lambda: 0 <= accounted() <= len(beats), 15,
             what="every claimed tick to run or be counted")
    wait_for(lambda: len(tick_events(events, "long", "end")) == len(
        tick_events(events, "long", "start")), 10, what="the last run to end")

    starts = tick_events(events, "long", "start")
    ends = tick_events(events, "long", "end")
    assert all(e["concurrent"] == 1 for e in starts)
    ran = Counter(e["singleton_beat_tick"] for e in starts)
    assert set(ran.values()) == {1}
    logs = "".join(b.logs() for b in beats)
    if mode == "skip":
        assert counted()["overlap_skipped"] >= 2
        assert "Beat entry 'long' tick" in logs and "skipped: the previous run still runs" in logs
    else:
        assert counted()["buffered"] >= 2 and counted()["buffer_dropped"] >= 1
        assert "buffered: the previous run still runs" in logs
        # a buffered tick (nominally due while the previous run ran) started right after it
        end_times = [e["at"] for e in ends]
        assert any(parse(s["singleton_beat_tick"]).timestamp() < end_at < s["at"]
                   for s in starts for end_at in end_times)


def test_after_a_late_start_or_restart_no_tick_is_skipped_for_the_late_run(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """Three beats brought up late in a period, killed (-9) together and
    brought up again until three starts came late enough (at most ten); a
    0.9 s SingletonTask every 1.5 s under ``skip`` (the default). The first
    tick after each start is sent as the beats come up, late, and its run
    still runs (or has not even started, a worker slow to pick it up) when
    the next tick comes: that tick waits for it (at most as long as the first
    was late) and runs right after it instead of being skipped. Every tick
    from the first after a start on runs, each once, never two at once.
    (Before, the second tick after a start was skipped whenever the start
    fell late in the period, and one after a run not started yet was refused
    at the worker.)"""
    period, run = 1.5, 0.9
    key = uuid.uuid4().hex[:8]
    sched = {"late": {"task": "t.tick_hold", "every": period,
                      "kwargs": {"key": key, "seconds": run}}}

    def runs(ev: str = "start") -> list[dict[str, Any]]:
        return sorted(tick_events(events, "late", ev), key=lambda e: e["at"])

    step = dt.timedelta(seconds=period)
    startup = 1.5  # launch to first send, measured at each start
    cycles: list[dict[str, Any]] = []
    while len(cycles) < 10 and sum(c["overlapped"] for c in cycles) < 3:
        # launch so the beats come up about 1.1 s into a period: the first run
        # (0.9 s) then still runs when the next tick comes, 0.4 s later
        time.sleep((1.1 - (time.time() + startup)) % period)
        launched = time.time()
        group = [Beat(redis_server.url(), beat_worker.queue, sched,
                      name=f"{name}{len(cycles)}").start() for name in "abc"]
        beats.extend(group)
        first = wait_for(lambda t=launched: [e for e in runs() if e["at"] > t], 30,
                         what="the first run after the start")[0]
        startup = first["at"] - launched
        t0 = parse(first["singleton_beat_tick"])
        third = t0 + 2 * step
        wait_for(lambda t=third: [e for e in runs() if parse(e["singleton_beat_tick"]) >= t],
                 30, what="the third tick after the start to run (or a later one)")
        for beat in group:
            beat.kill()
        wait_for(lambda: len(runs("end")) == len(runs()), 15, what="the runs to end")
        ends = {e["id"]: e["at"] for e in runs("end")}
        mine = [e for e in runs() if e["at"] >= first["at"]]
        cycles.append({
            "wanted": [tick_name(t0 + n * step) for n in range(3)],
            "ran": [e["singleton_beat_tick"] for e in mine],
            # the first run had not ended (or not even started) at the next
            # tick's nominal time
            "overlapped": ends[first["id"]] > (t0 + step).timestamp(),
            "unstarted": first["at"] > (t0 + step).timestamp(),
            "late": first["at"] - t0.timestamp(),
            "next_after": [e["at"] - (t0 + step).timestamp() for e in mine
                           if e["singleton_beat_tick"] == tick_name(t0 + step)],
            "third_after": [e["at"] - third.timestamp() for e in mine
                            if e["singleton_beat_tick"] == tick_name(third)],
        })
        # the next start comes after a period with no beat up: a tick no one claimed
        quiet = ends[mine[-1]["id"]] + period
        wait_for(lambda t=quiet: time.time() > t, 10, what="a quiet period")

    for c in cycles:  # the figures docs/beat.md quotes (pytest -s)
        print(f"first tick sent {c['late']:.2f} s late, its run in the next tick's way: "
              f"{c['overlapped']} (not started yet: {c['unstarted']}); the next tick ran "
              f"{c['next_after']} s after its time, the one after {c['third_after']} s")
    def history() -> str:
        """Every run (tick, start, end) and what the beats said of the entry."""
        done = {e["id"]: e["at"] for e in runs("end")}
        lines = [f"run of {e['singleton_beat_tick']}: {e['at']:.3f}-{done.get(e['id'], 0):.3f}"
                 f" ({e['id']})" for e in runs()]
        lines += [line for beat in beats for line in beat.logs().splitlines()
                  if "'late'" in line]
        return "\n".join([repr(cycles), *lines])

    assert sum(c["overlapped"] for c in cycles) >= 2, history()  # the case at hand came up
    for c in cycles:
        assert set(c["wanted"]) <= set(c["ran"]), history()
    starts = runs()
    assert set(Counter(e["singleton_beat_tick"] for e in starts).values()) == {1}, history()
    assert all(e["concurrent"] == 1 for e in starts), history()
    ends = {e["id"]: e["at"] for e in runs("end")}
    for before, after in zip(starts, starts[1:]):
        assert ends[before["id"]] <= after["at"], history()
    counted = Counter[str]()
    for st in stats(events).values():
        counted.update({k: int(v) for k, v in st.items() if k != "beat_id"})
    assert counted["waited_for_late_run"] >= sum(c["overlapped"] for c in cycles)


def test_a_tick_buffered_by_a_beat_killed_meanwhile_is_sent_by_another(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """buffer_one: while the task's key is held, one of two beats buffers a
    tick; it is killed (-9) before the key is freed. The other beat, which
    looks every second for buffered ticks it does not hold, sends that tick
    as soon as the key is free, not the next tick in its place."""
    from tests.beatapp import make_beat_app

    key = uuid.uuid4().hex[:8]
    # Hourly, with a catch-up window longer than the hour: each beat decides
    # the latest tick at start, and the next one is far away. With a short
    # interval the next tick could come before the survivor looks for the
    # buffer; it would then stand for the buffered one (which is dropped).
    sched = {"waits": {"task": "t.tick_hold", "every": 3600,
                       "kwargs": {"key": key, "seconds": 0.0},
                       "options": {"singleton_overlap": "buffer_one"}}}
    conf = {"singleton_beat_catchup": 7200}
    wait_for(lambda: time.time() % 3600 < 3540, 61, what="a minute before the hour is over")
    app = make_beat_app(redis_server.url(), beat_worker.queue)
    keys = app.tasks["t.tick_hold"].singleton_keys(key)
    engine = engine_for(app)
    engine.acquire(keys, Request(task_id="earlier-run", exec_id="earlier-exec",
                                 lease=Lease.of_ms(60_000), hostname="test@host", retries=0,
                                 task_name="t.tick_hold"))
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          conf=conf).start())
    waiting = wait_for(lambda: r.get(buffer_key("singleton:", "waits")), 30,
                       what="a tick buffered while the key is held")
    tick = from_ms(int(waiting))
    buffering = r.get(claim_key("singleton:", "waits", tick))  # who claimed it buffered it
    victim = next(b for b in beats if b.proc is not None
                  and b.proc.pid == int(buffering.split(":")[1]))
    victim.kill()
    assert engine.release(keys, "earlier-exec", "earlier-run", finished=False)

    def ran() -> list[dict[str, Any]]:
        return [e for e in tick_events(events, "waits", "start")
                if e["singleton_beat_tick"] == tick_name(tick)]

    wait_for(ran, 30, what="the buffered tick to run after its beat died")
    assert ran()[0]["singleton_beat_id"] != buffering
    survivor = next(b for b in beats if b is not victim)
    assert "sent from the buffer" in survivor.logs()


def test_a_buffered_tick_older_than_a_tick_decided_since_is_dropped_not_sent(redis_server):
    """A buffer found after a newer tick of its entry was decided (sent, say,
    because the run had ended by then) stands for nothing: sending it would
    run an older tick after a newer one. It is dropped and counted; a buffer
    of the latest tick is sent."""
    from tests.beatapp import make_beat_app
    from tests.contract.promises import VirtualScheduler

    app = make_beat_app(redis_server.url(), "unused", schedule={
        "late": {"task": "t.tick_hold", "every": 4, "kwargs": {"key": uuid.uuid4().hex},
                 "options": {"singleton_overlap": "buffer_one"}}})
    beat = VirtualScheduler(app=app)
    beat.sent = []
    entry = beat.schedule["late"]
    client = engine_for(app).client
    older = dt.datetime(2030, 1, 1, 0, 0, 4, tzinfo=UTC)
    newer = older + dt.timedelta(seconds=4)
    for decided, expect_sent in ((newer, False), (older, True)):
        client.set(buffer_key("singleton:", "late"), str(int(older.timestamp() * 1000)))
        beat._done["late"] = decided
        beat.overlap._buffered["late"] = entry
        beat.overlap._send_buffered()
        assert client.get(buffer_key("singleton:", "late")) is None
        assert bool(beat.sent) is expect_sent, (decided, beat.sent)
    assert beat.sent == [("late", older, beat.beat_id)]
    assert beat.singleton_stats["buffer_dropped"] == 1


class NotingScheduler(promises.VirtualScheduler):  # type: ignore[misc]
    """The virtual-clock beat, noting a late send (before it) as a real send does."""

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        self.overlap.note_if_late(entry, tick)
        super()._send(entry, tick, producer)


class SendingScheduler(SingletonSchedulerMixin, Scheduler):  # type: ignore[misc]
    """The mixin over Celery's in-memory scheduler on a virtual clock, sending
    for real (through the app's broker, the test Redis); ``during_send`` runs
    inside each send, before the message goes."""

    clock: dt.datetime
    sent: list[tuple[str, dt.datetime, str]]

    def singleton_now(self) -> dt.datetime:
        return self.clock

    def during_send(self) -> None:
        pass

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        self.during_send()
        result = super().apply_async(entry, producer, advance, **kwargs)
        self.sent.append((entry.name, self._sending[entry.name], self.beat_id))
        return result


def virtual_look(beat: Any, t0: dt.datetime, seconds: float) -> list[dt.datetime]:
    """A virtual-clock beat's loop once, ``seconds`` after ``t0``: every tick
    it has sent so far."""
    beat.clock = t0 + dt.timedelta(seconds=seconds)
    beat.overlap.before_tick()
    for entry in list(beat.schedule.values()):
        if beat.is_due(entry)[0]:
            beat.apply_entry(entry)
    return [tick for _, tick, _ in beat.sent]


class LateTick:
    """The late-run scene on a virtual clock (every 10 s): the first tick
    ``t0`` sent 0.2 s late (its note left for the next tick); its run's lock
    is granted (real, on the lock Redis) when :meth:`grant` says, as a slow
    worker gives it, with the tick's run marker the worker writes then."""

    def __init__(self, redis_server: RedisServer) -> None:
        from tests.beatapp import make_beat_app

        key, self.name = uuid.uuid4().hex, f"slow-{uuid.uuid4().hex[:8]}"
        self.app = make_beat_app(redis_server.url(), "unused", schedule={
            self.name: {"task": "t.tick_hold", "every": 10, "kwargs": {"key": key}}})
        self.beat = NotingScheduler(app=self.app)
        self.beat.sent = []
        self.t0 = dt.datetime(2030, 1, 1, 0, 0, 0, tzinfo=dt.timezone.utc)
        self.engine = engine_for(self.app)
        self.keys = self.app.tasks["t.tick_hold"].singleton_keys(key=key)
        assert self.look(0.2) == [self.t0]  # the first tick, sent 0.2 s late

    def look(self, seconds: float) -> list[dt.datetime]:
        """The beat's loop once, ``seconds`` after ``t0``: every tick sent so far."""
        return virtual_look(self.beat, self.t0, seconds)

    def grant(self, seconds: float, marker: bool = True, n: int = 0) -> None:
        """The run of tick ``n`` (``t0`` + n periods) takes the key ``seconds``
        after ``t0`` (exec-n, run-n); ``marker``: and writes the tick's run
        marker, as a worker does."""
        from tests.support import write_owner

        assert self.engine.acquire(self.keys, Request(
            task_id=f"run-{n}", exec_id=f"exec-{n}", lease=Lease.of_ms(60_000),
            hostname="w1@slow", task_name="t.tick_hold")).token > 0
        started = self.t0 + dt.timedelta(seconds=seconds)
        write_owner(self.engine.client, self.keys.lock, at=int(started.timestamp() * 1_000_000))
        tick = self.t0 + n * dt.timedelta(seconds=10)
        assert not marker or claim_tick_run(self.engine, get_config(self.app).key_prefix, {
            "singleton_beat_entry": self.name, "singleton_beat_tick": tick_name(tick),
            "id": f"run-{n}"})

    def end(self, n: int = 0) -> None:
        assert self.engine.release(self.keys, f"exec-{n}", f"run-{n}") is True

    @contextlib.contextmanager
    def granted_after_the_next_look_at_the_key(self, seconds: float
                                                ) -> Iterator[list[dict[str, str]]]:
        """Within the block, ``t0``'s run takes the key (:meth:`grant`) right
        after the beat's first look at it, which still finds it free; yields
        what each look found."""
        owner = self.engine.owner
        looks: list[dict[str, str]] = []

        def owner_then_grant(keys: Any) -> dict[str, str]:
            record = owner(keys)
            looks.append(record)
            if len(looks) == 1:
                self.grant(seconds)
            return record

        self.engine.owner = owner_then_grant
        try:
            yield looks
        finally:
            del self.engine.owner

    @property
    def stats(self) -> Counter[str]:
        return self.beat.singleton_stats  # type: ignore[no-any-return]


def a_run_started_late(redis_server: RedisServer) -> tuple[Any, Callable[[float], Any],
                                                           Any, Any, dt.datetime]:
    """The late-run scene, its run granted 3 s after the tick; the beat has
    looked again at 5 s. (beat, look(seconds) -> ticks sent, engine, the run's
    keys, t0)."""
    scene = LateTick(redis_server)
    scene.grant(3.0)
    scene.look(5.0)
    return scene.beat, scene.look, scene.engine, scene.keys, scene.t0


def test_a_run_a_slow_worker_started_late_costs_the_next_tick_nothing(redis_server):
    """A late start costs no tick, when the worker is what was slow too: a
    tick sent 0.2 s late (its note left for the next tick), whose run's grant
    comes 3 s after the tick (the worker slow to pick it up). At the next tick
    that run is still in the way: the tick waits as long as the run started
    late (the grant's time in the owner record), not only as long as the send
    was, and is sent once the run ended, 1.5 s into that wait; none is skipped.
    On a virtual clock (every 10 s), the lock Redis and the run's lock real."""
    beat, look, engine, keys, t0 = a_run_started_late(redis_server)
    look(10.05)  # the next tick: the run is in the way, and the tick waits
    assert beat.singleton_stats["waited_for_late_run"] == 1, beat.singleton_stats
    look(11.0)  # past the send's 0.2 s, within the start's 3 s: still waits
    look(11.4)
    assert [tick for _, tick, _ in beat.sent] == [t0]
    assert engine.release(keys, "exec-0", "run-0") is True  # the run ends
    look(11.6)
    assert [tick for _, tick, _ in beat.sent] == [t0, t0 + dt.timedelta(seconds=10)]
    assert beat.singleton_stats["overlap_skipped"] == 0, beat.singleton_stats


def test_a_tick_waiting_for_a_late_run_is_skipped_if_that_run_outlasts_the_wait(
        redis_server, caplog):
    """docs/beat.md: the wait for a late run is bounded by how late it started;
    a run still running at the bound costs the tick (skipped, counted, and
    logged saying so), and the tick is not sent when the run ends after. Same
    virtual clock and lock as the test above, the run never ending inside
    the wait."""
    beat, look, engine, keys, t0 = a_run_started_late(redis_server)
    assert look(10.05) == [t0]
    assert beat.singleton_stats["waited_for_late_run"] == 1, beat.singleton_stats
    assert look(12.5) == [t0]  # within the wait (the run started 3 s late)
    assert beat.singleton_stats["overlap_skipped"] == 0, beat.singleton_stats
    with caplog.at_level(logging.INFO, logger="celery_singleton_lock"):
        assert look(13.5) == [t0]  # past it, the run still running: skipped
    assert beat.singleton_stats["overlap_skipped"] == 1, beat.singleton_stats
    assert f"tick {tick_name(t0 + dt.timedelta(seconds=10))} skipped: the previous run still " \
        "runs (waited for it until" in caplog.text, caplog.text
    assert engine.release(keys, "exec-0", "run-0") is True
    assert look(14.0) == [t0]
    # the tick after the skipped one, noted to wait for its run, does not: the
    # skip left the skipped tick's run marker
    assert look(20.05) == [t0, t0 + dt.timedelta(seconds=20)]
    assert beat.singleton_stats["waited_for_late_run"] == 1, beat.singleton_stats


def test_a_late_ticks_run_a_worker_had_not_started_by_the_next_tick_costs_that_tick_nothing(
        redis_server):
    """docs/beat.md (a late start or restart): the late tick's message still
    waits for a worker at the next tick, so no run is in the way yet. Sent
    then, the next tick would meet it at the workers and one of the two would
    be refused as a duplicate. It waits instead: for the late run to start
    (its run marker) and to end, and is sent then; none is skipped. (Before,
    it was sent at once.) Virtual clock, every 10 s; the lock Redis real."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    assert scene.look(10.05) == [t0]  # nothing in the way, but t0's run not started
    assert scene.stats["waited_for_late_run"] == 1, scene.stats
    assert scene.look(12.0) == [t0]
    scene.grant(12.5)  # the worker takes t0 up at last
    assert scene.look(13.0) == [t0]  # its run in the way now
    scene.end()
    assert scene.look(13.3) == [t0, t0 + step]  # sent once that run ended
    assert scene.stats["overlap_skipped"] == 0, scene.stats


def test_a_late_ticks_run_granted_while_the_next_tick_looks_is_waited_for(redis_server):
    """The late run's grant lands between the next tick's look at the key
    (free) and its look at the run marker (there now): the run was not taken
    for one that started and ended; the tick waits for it and is sent once it
    ended. (A run started that way was once read as over, the tick sent at
    once and refused at the worker.)"""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    with scene.granted_after_the_next_look_at_the_key(10.06) as looks:
        assert scene.look(10.05) == [t0]
    assert looks[0] == {}, looks
    assert scene.stats["waited_for_late_run"] == 1, scene.stats
    assert scene.look(11.0) == [t0]
    scene.end()
    assert scene.look(11.3) == [t0, t0 + step]
    assert scene.stats["overlap_skipped"] == 0, scene.stats


def test_a_late_ticks_run_granted_while_the_waiting_tick_looks_again_is_waited_for(
        redis_server):
    """The same race later: the next tick already waits for a late run that
    had not started, and the grant lands within one of its looks, after the
    look at the key. It goes on waiting (the marker is looked at before the
    key), and is sent once that run ended."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    assert scene.look(10.05) == [t0]  # waits: not started
    with scene.granted_after_the_next_look_at_the_key(11.0) as looks:
        assert scene.look(11.0) == [t0]
    assert looks[0] == {}, looks
    assert scene.look(11.5) == [t0]  # the run holds the key
    scene.end()
    assert scene.look(11.8) == [t0, t0 + step]
    assert scene.stats["overlap_skipped"] == 0, scene.stats


def test_a_run_in_the_way_without_a_run_marker_is_waited_for_until_it_ends(redis_server):
    """docs/beat.md: the run in the way is taken for the late tick's, whatever
    sent it; one that leaves no run marker (a call of the task with the
    entry's arguments, not sent by the beat) is waited for as well, and the
    tick is sent once it ended (it was seen holding the key: over, not yet to
    start)."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    scene.grant(3.0, marker=False)
    assert scene.look(10.05) == [t0]
    assert scene.stats["waited_for_late_run"] == 1, scene.stats
    scene.end()
    assert scene.look(10.4) == [t0, t0 + step]
    assert scene.stats["overlap_skipped"] == 0, scene.stats


def test_a_tick_decided_past_its_late_runs_wait_is_skipped_and_counted(redis_server):
    """A beat that decides the next tick only after the late run's wait is
    over (it stalled), the run still in the way: the tick is skipped at once,
    counted and logged as any skip, not left waiting."""
    scene = LateTick(redis_server)
    scene.grant(0.3)  # the wait: until 10.3 s
    assert scene.look(10.5) == [scene.t0]
    assert scene.stats["overlap_skipped"] == 1, scene.stats
    assert scene.stats["waited_for_late_run"] == 0, scene.stats


def test_a_late_note_redis_cannot_read_leaves_the_tick_decided_as_without_one(redis_server):
    """The late note's GET fails (Redis errs): nothing in the way, the tick is
    sent at its time, not held back by a note nobody could read."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    read = scene.engine.read

    def failing(key: str) -> Any:
        if key.endswith(":late"):
            raise redis.ConnectionError("the late note's read failed")
        return read(key)

    scene.engine.read = failing
    try:
        assert scene.look(10.05) == [t0, t0 + step]
    finally:
        del scene.engine.read
    assert scene.stats["waited_for_late_run"] == 0, scene.stats


def test_a_waiting_tick_sent_after_the_next_ticks_time_is_waited_for_by_that_tick(
        redis_server):
    """The tick after a late one waits for the late run and goes late in turn,
    here past the next tick's time (its beat looked again only then), while
    another beat decided that next tick first: that one waits for the
    waiting tick's run (noted when the waiting began), and is sent once that
    run ended. (Sent at once, it met the waiting tick's run at the workers.)"""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    other = NotingScheduler(app=scene.app)
    other.sent = []

    def other_looks(seconds: float) -> list[dt.datetime]:
        return virtual_look(other, t0, seconds)

    scene.grant(3.0)
    assert scene.look(10.05) == [t0]  # t0 + 10 waits for t0's run (until 13 s)
    scene.end()  # at 12 s, say; this beat looks again only at 20.3 s
    assert other_looks(20.05) == []  # t0 + 20: claimed, waits for t0 + 10's run
    assert other.singleton_stats["waited_for_late_run"] == 1, other.singleton_stats
    assert scene.look(20.3) == [t0, t0 + step]  # sent late, past t0 + 20's time
    scene.grant(20.4, n=1)
    assert other_looks(20.8) == []
    scene.end(n=1)
    assert other_looks(21.4) == [t0 + 2 * step]
    skipped = scene.stats["overlap_skipped"] + other.singleton_stats["overlap_skipped"]
    assert skipped == 0, (scene.stats, other.singleton_stats)


def test_a_beat_deciding_the_next_tick_while_the_late_one_is_sent_finds_its_note(
        redis_server):
    """The late note is written before the late tick's message goes: a beat
    that decides the next tick while that send is under way (right at the
    next tick's time) finds it, and waits for the late run instead of
    sending into it. (Written after the send, the note came too late for
    it.) The late beat sends for real, through the app's broker."""
    from tests.beatapp import make_beat_app

    key, name = uuid.uuid4().hex, f"edge-{uuid.uuid4().hex[:8]}"
    app = make_beat_app(redis_server.url(), f"unused-{key[:8]}", schedule={
        name: {"task": "t.tick_hold", "every": 10, "kwargs": {"key": key}}})
    t0 = dt.datetime(2030, 1, 1, 0, 0, 0, tzinfo=dt.timezone.utc)
    late, other = SendingScheduler(app=app), NotingScheduler(app=app)
    late.sent, other.sent = [], []
    seen: list[list[dt.datetime]] = []
    late.during_send = lambda: seen.append(virtual_look(other, t0, 10.01))  # type: ignore[method-assign]
    assert virtual_look(late, t0, 9.98) == [t0]  # the beat came up 9.98 s late
    assert seen == [[]], seen  # the next tick, decided meanwhile, was not sent
    assert other.singleton_stats["waited_for_late_run"] == 1, other.singleton_stats


def test_a_late_tick_whose_send_failed_leaves_the_next_tick_nothing_to_wait_for(
        redis_server):
    """The late note goes before the send; when the send then fails (the
    broker refused it, logged by Celery), the note is taken back: the next
    tick is sent at its time, not held for a run that never comes."""
    from tests.beatapp import make_beat_app

    key, name = uuid.uuid4().hex, f"edge-{uuid.uuid4().hex[:8]}"
    app = make_beat_app(redis_server.url(), f"unused-{key[:8]}", schedule={
        name: {"task": "t.tick_hold", "every": 10, "kwargs": {"key": key}}})
    t0 = dt.datetime(2030, 1, 1, 0, 0, 0, tzinfo=dt.timezone.utc)
    late, other = SendingScheduler(app=app), NotingScheduler(app=app)
    late.sent, other.sent = [], []

    def refused() -> None:
        raise OSError("the broker refused the message")

    late.during_send = refused  # type: ignore[method-assign]
    assert virtual_look(late, t0, 3.0) == []  # the late tick: noted, its send failed
    assert engine_for(app).read(late_key(get_config(app).key_prefix, name)) is None
    assert virtual_look(other, t0, 10.05) == [t0 + dt.timedelta(seconds=10)]
    assert other.singleton_stats["waited_for_late_run"] == 0, other.singleton_stats


def test_a_late_ticks_run_that_never_starts_holds_the_next_tick_until_the_one_after(
        redis_server):
    """The wait for a late run that has not started is bounded by the tick
    after the waiting one: then that tick is skipped (counted) and the one
    after it is decided as usual (nothing in the way: sent)."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    assert scene.look(10.05) == [t0]
    assert scene.look(19.9) == [t0]
    assert scene.stats["overlap_skipped"] == 0, scene.stats
    assert scene.look(20.05) == [t0, t0 + 2 * step]
    assert scene.stats["overlap_skipped"] == 1, scene.stats


def test_a_late_ticks_run_that_ended_before_the_next_tick_costs_that_tick_no_wait(
        redis_server):
    """The common case after a late start: the late tick's run started and
    ended before the next tick's time (its run marker there, the key free).
    The next tick is sent at its time, without waiting."""
    scene = LateTick(redis_server)
    t0, step = scene.t0, dt.timedelta(seconds=10)
    scene.grant(1.0)
    scene.end()
    assert scene.look(10.05) == [t0, t0 + step]
    assert scene.stats["waited_for_late_run"] == 0, scene.stats
    # sent 50 ms after its time, that tick left no note of its own (t0's stays)
    note = scene.engine.read(late_key(get_config(scene.app).key_prefix, scene.name))
    assert str(note).split()[0] == str(to_ms(t0 + step)), note


@pytest.mark.parametrize("deadline,late,cron_sent", [
    (None, 20.0, True),   # unset: the catch-up window (60 s) alone
    (10, 5.0, True),      # within the deadline
    (10, 20.0, False),    # past the deadline, within the catch-up window
    (300, 30.0, True),    # a deadline wider than the window: the window
    (300, 90.0, False),   # past the window, within the deadline
])
def test_beat_cron_starting_deadline_narrows_the_catch_up_window_of_crontab_entries_only(
        redis_server, deadline, late, cron_sent):
    """docs/beat.md (Catch-up after every beat was down): for crontab entries,
    Celery's ``beat_cron_starting_deadline``, when set, narrows the window
    (the smaller of the two); a tick older than the window is not sent, and
    the entry next runs at its next fire time. An interval entry keeps the
    whole window. A beat comes up ``late`` seconds after a fire time of both
    (hourly), on a virtual clock; claims on the real lock Redis."""
    from tests.beatapp import make_beat_app

    cron, every = f"cron-{uuid.uuid4().hex[:8]}", f"every-{uuid.uuid4().hex[:8]}"
    conf = {} if deadline is None else {"beat_cron_starting_deadline": deadline}
    app = make_beat_app(redis_server.url(), "unused", conf=conf, schedule={
        cron: {"task": "t.tick", "crontab": {"minute": 0}},
        every: {"task": "t.tick", "every": 3600}})
    assert app.conf.beat_cron_starting_deadline == deadline
    beat = NotingScheduler(app=app)
    beat.sent = []
    t0 = dt.datetime(2030, 1, 1, 0, 0, 0, tzinfo=UTC)

    def sent(entry: str) -> list[dt.datetime]:
        return [tick for name, tick, _ in beat.sent if name == entry]

    virtual_look(beat, t0, late)
    assert sent(cron) == ([t0] if cron_sent else []), (deadline, late, beat.sent)
    assert sent(every) == ([t0] if late <= 60 else []), (deadline, late, beat.sent)
    virtual_look(beat, t0, 3600.05)  # the next fire time: sent, whatever came before
    hour = t0 + dt.timedelta(hours=1)
    assert sent(cron) == ([t0, hour] if cron_sent else [hour]), beat.sent


def test_a_solar_entry_sends_its_latest_fire_time_once(redis_server):
    """docs/beat.md (How a tick is named): a ``solar`` entry's tick is its
    latest fire time not after now, in UTC, as a crontab's is. Sunrise in
    Berlin on a virtual clock (the schedule's own ``now`` is the beat's): the
    beat an hour after it sends that sunrise once, looks again and sends
    nothing, and a day later sends the next sunrise (the one before it
    skipped, as after any downtime). Celery's solar needs ``ephem`` (the test
    extra has it)."""
    from celery.schedules import solar

    from tests.beatapp import make_beat_app

    name = f"sunrise-{uuid.uuid4().hex[:8]}"
    t0 = dt.datetime(2030, 6, 1, 4, 0, 0, tzinfo=UTC)  # sunrise there: about 02:50 UTC
    clock = [t0]
    sunrise = solar("sunrise", 52.52, 13.40, nowfun=lambda: clock[-1])
    app = make_beat_app(redis_server.url(), "unused",
                        conf={"singleton_beat_catchup": 7200})
    app.conf.beat_schedule = {name: {"task": "t.tick", "schedule": sunrise}}
    beat = NotingScheduler(app=app)
    beat.sent = []

    def look(at: dt.datetime) -> list[dt.datetime]:
        clock.append(at)
        return virtual_look(beat, at, 0)

    first = look(t0)
    assert len(first) == 1 and dt.datetime(2030, 6, 1, 2, 30, tzinfo=UTC) < first[0] < t0, first
    assert look(t0 + dt.timedelta(minutes=30)) == first
    later = look(t0 + dt.timedelta(days=2))
    assert len(later) == 2 and later[1] - first[0] > dt.timedelta(days=1, hours=23), later
    assert later[1] < t0 + dt.timedelta(days=2)


def test_redis_down_at_a_tick_sends_nothing_logs_the_entry_and_the_beat_lives_on(
        redis_server, beat_worker, beats, events, own_redis, clean_stats):
    """Lock Redis stopped: those ticks are not sent (error names the entry), never
    sent later either; the beats keep running and ticks resume when Redis is back."""
    sched = {"outage": {"task": "t.tick", "every": 1}}
    for name in ("a", "b"):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          lock_url=own_redis.url(2)).start())

    def seen() -> list[str]:
        return [e["singleton_beat_tick"] for e in tick_events(events, "outage")]

    wait_for(lambda: len(seen()) >= 2, 30, what="2 ticks")
    own_redis.stop()
    down_since = time.time()
    wait_for(lambda: sum(b.logs().count("Beat entry 'outage' tick") for b in beats) >= 4, 20,
             what="errors naming the entry")
    own_redis.start()
    back_at = time.time()
    wait_for(lambda: len([t for t in seen() if parse(t).timestamp() > back_at]) >= 2, 30,
             what="ticks after Redis is back")
    assert all(b.alive for b in beats)
    for beat in beats:
        beat.stop()
    counts = Counter(seen())
    assert set(counts.values()) == {1}, counts
    errors = [line for b in beats for line in b.logs().splitlines()
              if "not sent: Redis unreachable" in line]
    assert errors and all("'outage'" in line for line in errors)
    during = {t for t in counts if down_since + 0.5 < parse(t).timestamp() < back_at - 1.5}
    assert not during, f"ticks of the outage were sent: {during}"


def test_redis_down_with_send_policy_still_sends_the_tick(
        redis_server, beat_worker, beats, events, own_redis, clean_stats):
    """singleton_beat_on_backend_error="send": an unclaimed tick is sent, with a warning."""
    sched = {"fail-open": {"task": "t.tick", "every": 1}}
    own_redis.stop()
    beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name="open",
                      lock_url=own_redis.url(2),
                      conf={"singleton_beat_on_backend_error": "send"}).start())
    wait_for(lambda: len(tick_events(events, "fail-open")) >= 2, 30,
             what="ticks sent while Redis is down")
    assert "sent WITHOUT a claim: Redis unreachable" in beats[0].logs()
