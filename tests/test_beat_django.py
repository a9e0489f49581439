"""The mixin over django-celery-beat's DatabaseScheduler (SQLite): one send per tick.

Skipped when django-celery-beat is not installed.
"""

from __future__ import annotations

import datetime as dt
import tempfile
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("django_celery_beat")

UTC = dt.timezone.utc


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
