"""Beat across daylight-saving changes: real `celery beat` processes on a faked clock.

Two ``SingletonScheduler`` beats run under one libfaketime wrapper, so they
share a clock that starts shortly before a change in America/New_York and runs
360 times faster than the real one: two fake hours take 20 real seconds. The
beat whose send is the last before the change is killed with ``kill -9``.
Redis is on the real clock. What the beats sent is read from the broker queue
itself (no worker: the real clock's worker would only add its own run check),
so "each intended time exactly once" is counted from the messages sent.

The beats' socket timeouts are raised: a faked clock speeds them up too.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support import ROOT, RedisServer, installed, missing, wait_for

FAKETIME = shutil.which("faketime")
pytestmark = pytest.mark.worker


@pytest.fixture(autouse=True)
def needs_faketime() -> None:
    if FAKETIME is None:
        missing("libfaketime's faketime is not installed (apt-get install faketime)")

UTC = dt.timezone.utc
SPEED = 360
ZONE = "America/New_York"
#: a faked clock speeds up every timeout: these last 10 real seconds
SLOW = float(SPEED * 10)
#: how long before the first tick checked the beats start (4 real seconds; a
#: beat up after that tick sends only its catch-up, the latest missed one)
STARTUP = dt.timedelta(minutes=25)
CONF = {
    "timezone": ZONE,
    "singleton_beat_catchup": 600.0,  # 1.7 real seconds: a loaded machine's late wake-up
    "singleton_redis_options": {"socket_timeout": SLOW, "socket_connect_timeout": SLOW},
    "broker_connection_timeout": SLOW,
    "broker_transport_options": {"socket_timeout": SLOW, "socket_connect_timeout": SLOW},
}


def utc(*parts: int) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def name(tick: dt.datetime) -> str:
    return tick.isoformat(timespec="milliseconds")


def every(start: dt.datetime, end: dt.datetime, minutes: int) -> list[str]:
    out, t = [], start
    while t <= end:
        out.append(name(t))
        t += dt.timedelta(minutes=minutes)
    return out


def clear_stale_faketime() -> None:
    """libfaketime's semaphores and shared memory, named by the pid that made
    them, outlive a process killed -9: a wrapper later given the same pid
    refuses to start ("sem_open: File exists"). Those of dead pids go."""
    for path in Path("/dev/shm").glob("*faketime_s[eh][m]_*"):
        pid = int(path.name.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


class FakeClockBeats:
    """Beats started together under ``faketime -m -f "<offset> x<speed>"``,
    each with its own schedule file, log and process zone (``TZ``)."""

    def __init__(self, redis_url: str, queue: str, schedule: dict[str, Any],
                 start: dt.datetime, zones: tuple[str, ...]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="slt-dst-"))
        self.queue = queue
        self.start_at = start
        env = {"SLT_REDIS_URL": redis_url, "SLT_QUEUE": queue, "SLT_CONF": json.dumps(CONF),
               "SLT_BEAT_SCHEDULE": json.dumps(schedule),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.env = {**os.environ, **env, "TZ": "UTC", "FAKETIME_DONT_RESET": "1"}
        self.lines = []
        for i, zone in enumerate(zones):
            # the app is the current app, as a project's usually is
            cmd = ["env", f"TZ={zone}", f"SLT_BEAT_NAME=dst-{i}", "SLT_CURRENT_APP=1",
                   sys.executable, "-m",
                   "celery", "-A", "tests.beatapp:app", "beat",
                   "-S", "tests.beatapp:RecordingScheduler", "-s", str(self.dir / f"s{i}"),
                   "--pidfile=", "--loglevel", "INFO", "-f", str(self.dir / f"beat{i}.log")]
            self.lines.append(shlex.join(cmd) + " &")
        self.proc: subprocess.Popen[bytes] | None = None

    def run(self) -> FakeClockBeats:
        clear_stale_faketime()
        offset = int(self.start_at.timestamp() - time.time())
        script = " ".join(self.lines) + " wait"
        assert FAKETIME is not None
        with open(self.dir / "wrapper.log", "wb") as log:
            self.proc = subprocess.Popen(
                [FAKETIME, "-m", "-f", f"{offset:+d} x{SPEED}", "bash", "-c", script],
                env=self.env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)
        return self

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        clear_stale_faketime()


@pytest.fixture
def dst_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def sent(server: RedisServer, queue: str) -> list[dict[str, Any]]:
    """The headers of every message the beats sent (the broker queue, oldest first)."""
    raw = server.client(0).lrange(queue, 0, -1)
    return [json.loads(m)["headers"] for m in reversed(raw)]


def ticks_of(messages: list[dict[str, Any]], entry: str) -> Counter[str]:
    return Counter(str(h["singleton_beat_tick"]) for h in messages
                   if h.get("singleton_beat_entry") == entry)


def run_across(server: RedisServer, schedule: dict[str, Any], start: dt.datetime,
               last_before: dt.datetime, end: dt.datetime
               ) -> tuple[list[dict[str, Any]], int, str]:
    """Two beats (process zones New York and Tokyo) from ``start``; the one that
    sent entry ``q15``'s tick ``last_before`` is killed (kill -9) once it has;
    returns every message sent once ``q15``'s tick ``end`` was, the pid killed
    and the beats' logs."""
    queue = f"dst-{uuid.uuid4().hex[:8]}"
    beats = FakeClockBeats(server.url(), queue, schedule, start, (ZONE, "Asia/Tokyo")).run()
    try:
        def sender_of(tick: dt.datetime, entry: str = "q15") -> Any:
            return next((h["singleton_beat_id"] for h in sent(server, queue)
                         if h.get("singleton_beat_entry") == entry
                         and h["singleton_beat_tick"] == name(tick)), None)

        try:
            beat_id = wait_for(lambda: sender_of(last_before), 90,
                               what=f"the tick {name(last_before)} sent")
            pid = int(str(beat_id).split(":")[1])
            os.kill(pid, signal.SIGKILL)
            # every entry due at the end (on the hour) sent its tick: the same
            # instant, one entry after the other
            due = [e for e in ("q15", "hourly") if e in schedule]
            wait_for(lambda: all(sender_of(end, e) for e in due), 90,
                     what=f"the tick {name(end)} sent by the survivor")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{beats.logs()[-6000:]}") from None
        messages = sent(server, queue)
    finally:
        beats.stop()
    return messages, pid, beats.logs()


@contextlib.contextmanager
def history(messages: list[dict[str, Any]], logs: str) -> Iterator[None]:
    """A failed assertion inside shows every send, in order, and the beats' logs."""
    try:
        yield
    except AssertionError as exc:
        sends = "\n".join(f"  {h.get('singleton_beat_entry')} {h.get('singleton_beat_tick')} "
                          f"by {h.get('singleton_beat_id')}" for h in messages)
        raise AssertionError(f"{exc}\nsent, oldest first:\n{sends}\n{logs[-8000:]}") from None


def window(counts: Counter[str], start: dt.datetime, end: dt.datetime) -> Counter[str]:
    return Counter({t: n for t, n in counts.items() if name(start) <= t <= name(end)})


@pytest.mark.long
@pytest.mark.timeout(240)
def test_fall_back_every_intended_time_once_with_two_beats_one_killed(dst_redis):
    """2026-11-01, New York: 01:00-01:59 happens twice (05:00-06:59 UTC).
    ``*/15`` and ``minute=0`` run once per real period through both passes
    (Celery's own beat loses the second); ``hour=1, minute=30`` runs once."""
    schedule = {"q15": {"task": "t.tick", "crontab": "*/15"},
                "hourly": {"task": "t.tick", "crontab": {"minute": "0"}},
                "at0130": {"task": "t.tick", "crontab": {"minute": "30", "hour": "1"}}}
    first, last_before, end = utc(2026, 11, 1, 5), utc(2026, 11, 1, 5, 45), utc(
        2026, 11, 1, 7)
    messages, killed, logs = run_across(dst_redis, schedule, first - STARTUP, last_before, end)
    with history(messages, logs):
        fell_back(messages, killed, first, last_before, end)


def fell_back(messages: list[dict[str, Any]], killed: int, first: dt.datetime,
              last_before: dt.datetime, end: dt.datetime) -> None:
    q15 = window(ticks_of(messages, "q15"), first, end)
    assert sorted(q15) == every(first, end, 15), sorted(q15)
    assert set(q15.values()) == {1}, q15
    hourly = window(ticks_of(messages, "hourly"), first, end)
    assert hourly == Counter({name(utc(2026, 11, 1, h)): 1 for h in (5, 6, 7)}), hourly
    at0130 = window(ticks_of(messages, "at0130"), first, end)
    assert at0130 == Counter({name(utc(2026, 11, 1, 5, 30)): 1}), at0130
    after = [h for h in messages if h["singleton_beat_tick"] > name(last_before)]
    assert after and all(int(h["singleton_beat_id"].split(":")[1]) != killed for h in after)


@pytest.mark.long
@pytest.mark.timeout(240)
def test_spring_forward_a_time_in_the_gap_runs_once_with_two_beats_one_killed(dst_redis):
    """2026-03-08, New York: 02:00-02:59 does not exist. ``hour=2, minute=30``
    runs once, at 03:30 EDT (07:30 UTC); ``*/15`` and ``minute=0`` lose nothing."""
    schedule = {"q15": {"task": "t.tick", "crontab": "*/15"},
                "hourly": {"task": "t.tick", "crontab": {"minute": "0"}},
                "at0230": {"task": "t.tick", "crontab": {"minute": "30", "hour": "2"}}}
    first, last_before, end = utc(2026, 3, 8, 6), utc(2026, 3, 8, 6, 45), utc(2026, 3, 8, 8)
    messages, killed, logs = run_across(dst_redis, schedule, first - STARTUP, last_before, end)
    with history(messages, logs):
        sprang_forward(messages, killed, first, last_before, end)


def sprang_forward(messages: list[dict[str, Any]], killed: int, first: dt.datetime,
                   last_before: dt.datetime, end: dt.datetime) -> None:
    q15 = window(ticks_of(messages, "q15"), first, end)
    assert sorted(q15) == every(first, end, 15), sorted(q15)
    assert set(q15.values()) == {1}, q15
    hourly = window(ticks_of(messages, "hourly"), first, end)
    assert hourly == Counter({name(utc(2026, 3, 8, h)): 1 for h in (6, 7, 8)}), hourly
    at0230 = window(ticks_of(messages, "at0230"), first, end)
    assert at0230 == Counter({name(utc(2026, 3, 8, 7, 30)): 1}), at0230
    after = [h for h in messages if h["singleton_beat_tick"] > name(last_before)]
    assert after and all(int(h["singleton_beat_id"].split(":")[1]) != killed for h in after)


def test_a_schedule_read_back_from_the_file_keeps_the_beats_zone(dst_redis, tmp_path):
    """Celery pickles a crontab without its app: read back from the schedule
    file it would match its fields in the current app's zone (UTC), not this
    beat's app's, when that app is not the current one."""
    from celery_singleton_lock.beat import SingletonScheduler
    from tests.beatapp import make_beat_app

    app = make_beat_app(dst_redis.url(), "q", conf={"timezone": ZONE}, schedule={
        "at0130": {"task": "t.tick", "crontab": {"minute": "30", "hour": "1"}}})
    for _ in range(2):  # the second start reads the entry back from the file
        beat = SingletonScheduler(app=app, lazy=False, schedule_filename=str(tmp_path / "s"))

        class At(SingletonScheduler):
            def singleton_now(self) -> dt.datetime:
                return utc(2026, 11, 1, 5, 30, 1)

        beat.__class__ = At
        assert beat.is_due(beat.schedule["at0130"]).is_due
        beat.close()


def test_a_crontab_with_its_own_zone_keeps_it(dst_redis, tmp_path):
    """django-celery-beat's TzAwareCrontab carries the row's zone: giving a
    schedule the beat's app back never replaces a zone the schedule set itself."""
    installed("django_celery_beat", "the test extra")
    from zoneinfo import ZoneInfo

    from django_celery_beat.tzcrontab import TzAwareCrontab

    from celery_singleton_lock.beat import SingletonScheduler
    from tests.beatapp import make_beat_app

    app = make_beat_app(dst_redis.url(), "q", conf={"timezone": "UTC"})
    app.conf.beat_schedule = {"at0130": {"task": "t.tick", "schedule": TzAwareCrontab(
        minute=30, hour=1, tz=ZoneInfo(ZONE))}}

    class At(SingletonScheduler):
        def singleton_now(self) -> dt.datetime:
            return utc(2026, 11, 1, 5, 30, 1)  # 01:30:01 EDT, 05:30:01 UTC

    for _ in range(2):  # the second start reads the entry back from the file
        beat = At(app=app, lazy=False, schedule_filename=str(tmp_path / "s"))
        assert beat.is_due(beat.schedule["at0130"]).is_due
        beat.close()
