"""The mixin over django-celery-beat's DatabaseScheduler: one send per tick (two
schedulers in one process, SQLite), and every rule of the rows kept (real
`celery beat` processes, PostgreSQL).

Skipped when django-celery-beat is not installed (and the PostgreSQL test when
no PostgreSQL answers).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import pytest

import tests.beat.test_beat as beat_tests
from tests.beat.test_beat import parse
from tests.support import ROOT, installed, wait_for

UTC = dt.timezone.utc


@pytest.fixture(autouse=True, scope="module")
def needs_django_celery_beat() -> None:
    installed("django_celery_beat", "the test extra")


@pytest.fixture(scope="module")
def django_db() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                   "NAME": tempfile.mktemp(suffix=".sqlite3")}})
        django.setup()
    from django.core.management import call_command

    call_command("migrate", "django_celery_beat", verbosity=0)


def test_two_database_schedulers_with_the_mixin_send_each_tick_once(django_db, redis_server, r):
    """Two DatabaseSchedulers (clocks 2 s apart) over one SQLite schedule: each tick
    once, django's periodic_task_name header kept next to the tick headers."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    from celery_singleton_lock.beat import SingletonSchedulerMixin
    from tests.beatapp import make_beat_app

    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(name="db-report", defaults={
        "interval": every, "task": "t.tick"})
    app = make_beat_app(redis_server.url(), "unused")

    class Recording(DatabaseScheduler):  # type: ignore[misc]
        """Stands where the broker would: records what would be published."""

        sent: list[dict[str, Any]]

        def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                        **kwargs: Any) -> None:
            self.sent.append(dict(entry.options["headers"]))

    class Skewed(SingletonSchedulerMixin, Recording):  # type: ignore[misc]
        clock: dt.datetime
        offset = dt.timedelta(0)

        def singleton_now(self) -> dt.datetime:
            return self.clock + self.offset

    beats = []
    for offset in (0.0, 2.0):
        beat = Skewed(app=app)
        beat.offset = dt.timedelta(seconds=offset)
        beat.sent = []
        beats.append(beat)
    start = dt.datetime(2031, 1, 1, tzinfo=UTC)
    for step in range(0, 15_000, 100):
        for beat in beats:
            beat.clock = start + dt.timedelta(milliseconds=step)
            for entry in list(beat.schedule.values()):
                if entry.name == "db-report" and beat.is_due(entry)[0]:
                    beat.apply_entry(entry)
    sent = [h for beat in beats for h in beat.sent]
    counts = Counter(h["singleton_beat_tick"] for h in sent)
    assert len(counts) >= 15 and set(counts.values()) == {1}, counts
    assert {h["periodic_task_name"] for h in sent} == {"db-report"}
    assert {h["singleton_beat_entry"] for h in sent} == {"db-report"}


# -- real `celery beat` processes over PostgreSQL ------------------------------------------

beat_worker = beat_tests.beat_worker
beats = beat_tests.beats
clean_stats = beat_tests.clean_stats


def _djangobeat(db: str, redis_url: str, *argv: str) -> str:
    """``python -m tests.djangobeat ...`` against the test's database: its output."""
    env = {**os.environ, "SLT_PG_DB": db, "SLT_REDIS_URL": redis_url,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "tests.djangobeat", *argv], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.worker
def test_two_real_beats_over_postgresql_keep_every_rule_of_django_celery_beat(
        redis_server, beat_worker, beats, events, r, clean_stats):
    """Two `celery beat` processes, the mixin over django-celery-beat's
    DatabaseScheduler on PostgreSQL: each row's own due-check decides whether a
    tick exists, the mixin only which beat sends it. A one_off interval row
    runs once and ends disabled; a clocked row runs once, at its time, and ends
    disabled; a row with a start_time runs only from then on; a row with
    expires runs only until then and ends disabled; and the run counts in the
    database add up to the runs, whichever beat sent them, one beat killed
    (-9) and started again on the way."""
    from tests.beat.test_beat import Beat, claimed, every_claimed_tick_ran, tick_events
    from tests.pg import own_database

    with own_database() as dsn:
        db = dict(part.split("=", 1) for part in dsn.split())["dbname"]
        seeded = time.time()
        _djangobeat(db, redis_server.url(), "seed", json.dumps([
            {"name": "every", "every": 1},
            {"name": "oneoff", "every": 2, "one_off": True},
            {"name": "later", "every": 1, "start_in": 8},
            {"name": "expiring", "every": 1, "expires_in": 10},
            {"name": "clocked", "clocked_in": 5},
        ]))

        def beat(name: str) -> Beat:
            started = Beat(redis_server.url(), beat_worker.queue, {}, name=name,
                           app="tests.djangobeat:app",
                           scheduler="tests.djangobeat:SingletonDatabaseScheduler",
                           env={"SLT_PG_DB": db}).start()
            beats.append(started)
            return started

        def ran(entry: str) -> list[dict[str, Any]]:
            return tick_events(events, entry)

        victim = beat("a")
        beat("b")
        wait_for(lambda: len(ran("every")) >= 3, 60, what="three runs of the plain row")
        # half a second into a period: no beat is between a claim and a send
        time.sleep((0.5 - time.time() % 1) % 1)
        victim.kill()
        beat("a2")
        wait_for(lambda: len(ran("later")) >= 4 and time.time() > seeded + 14, 60,
                 what="four runs of the row with a start_time, 14 s after the seeding")
        for beat in beats:
            beat.stop()
        lost = {entry: every_claimed_tick_ran(r, entry, lambda e=entry: [
            x["singleton_beat_tick"] for x in ran(e)])  # but a tick a kill or a stop
            for entry in ("every", "later")}          # lost after its claim
        rows = {row["name"]: row for row in json.loads(_djangobeat(db, redis_server.url(),
                                                                    "rows"))}
        expiring_claims = claimed(r, "expiring")  # every tick a beat decided to send

    every = [e for e in events.all() if e["ev"] == "tick"]
    assert set(Counter((e["singleton_beat_entry"], e["singleton_beat_tick"])
                       for e in every).values()) == {1}
    assert all(e["periodic_task_name"] == e["singleton_beat_entry"] for e in every)
    logs = "".join(b.logs() for b in beats)
    # one_off: once, then the row is disabled (as the stock scheduler leaves it)
    assert len(ran("oneoff")) == 1, ran("oneoff")
    assert rows["oneoff"]["enabled"] is False
    # clocked: once, at its time, then disabled
    [clock] = ran("clocked")
    assert parse(clock["singleton_beat_tick"]).timestamp() == pytest.approx(
        rows["clocked"]["clocked"], abs=0.001)
    assert clock["at"] >= rows["clocked"]["clocked"]
    assert rows["clocked"]["enabled"] is False
    # start_time: nothing before it
    assert ran("later") and min(e["at"] for e in ran("later")) >= rows["later"]["start_time"]
    # expires: nothing decided after it; the row disabled
    assert ran("expiring")
    assert max(parse(t).timestamp() for t in expiring_claims) < rows["expiring"]["expires"]
    assert rows["expiring"]["enabled"] is False
    # run counts: one per send, whichever beat sent it; a send a stop cut short
    # (a tick lost after its claim) is counted when the stop came inside it
    for entry in ("every", "later"):
        assert len(ran(entry)) <= rows[entry]["total_run_count"] <= len(ran(entry)) + len(
            lost[entry]), (entry, rows[entry], lost[entry])
    senders = {e["singleton_beat_id"] for e in ran("every")}
    assert len(senders) >= 2, "more than one beat sent ticks of the row"
    # no traceback but Celery's own at a stop: its SIGTERM handler raises
    # SystemExit wherever beat is: inside a collected AsyncResult's __del__
    # (Python prints it as "Exception ignored"), or inside a send, which beat
    # logs as "Couldn't apply scheduled task" with the SystemExit chained
    told = re.split(r"\n(?=\[\d{4}-\d\d-\d\d )", logs)
    not_at_stop = [t for t in told if "Traceback (most" in t
                   and not ("in _sync" in t and "raise SystemExit()" in t)]
    assert not_at_stop == [], not_at_stop
