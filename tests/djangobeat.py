"""django-celery-beat on a PostgreSQL database, for real `celery beat` processes.

``celery -A tests.djangobeat:app beat -S tests.djangobeat:SingletonDatabaseScheduler``
runs the mixin over django-celery-beat's ``DatabaseScheduler``, as docs/beat.md
shows, publishing its counters as ``tests.beatapp.RecordingScheduler`` does. Its
tasks are those of ``tests.beatapp`` (``t.tick`` records the headers it arrives
with); its schedule is the database's.

``python -m tests.djangobeat seed '<json>'`` migrates the database and writes the
rows; ``python -m tests.djangobeat rows`` prints them as JSON. Django is
configured once per process, so the test drives the database through these.

Configured from the environment: ``SLT_PG_DB`` (the test's own database on the
server of :mod:`tests.pg`) and ``tests.beatapp``'s ``SLT_*`` variables.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from typing import Any

import django
from django.conf import settings

from tests.pg import PG_HOST, PG_PORT, PG_USER

settings.configure(
    INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql",
                           "NAME": os.environ.get("SLT_PG_DB", "postgres"),
                           "HOST": PG_HOST, "PORT": PG_PORT, "USER": PG_USER}},
)
django.setup()

from django_celery_beat.schedulers import DatabaseScheduler  # noqa: E402

from celery_singleton_lock.beat import SingletonSchedulerMixin  # noqa: E402
from tests.beatapp import _from_env, publish_stats  # noqa: E402

app = _from_env()


class SingletonDatabaseScheduler(SingletonSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """The mixin over django-celery-beat's scheduler, publishing its counters."""

    _published: dict[str, int] = {}  # noqa: RUF012 - replaced per instance on first publish

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay: float = super().tick(*args, **kwargs)
        self._published = publish_stats(self, self._published)
        return delay


def seed(rows: list[dict[str, Any]]) -> None:
    """Each row: ``name``, and ``every`` (seconds) or ``clocked_in`` (seconds
    from now); optional ``one_off``, ``start_in``, ``expires_in`` (seconds from
    now), ``enabled``. The task is ``t.tick`` with the row's name as its tag."""
    from django.core.management import call_command
    from django_celery_beat.models import ClockedSchedule, IntervalSchedule, PeriodicTask

    call_command("migrate", "django_celery_beat", verbosity=0)
    now = dt.datetime.now(dt.timezone.utc)
    for row in rows:
        when: dict[str, Any] = {}
        if "clocked_in" in row:
            when["clocked"] = ClockedSchedule.objects.create(
                clocked_time=now + dt.timedelta(seconds=row["clocked_in"]))
        else:
            when["interval"], _ = IntervalSchedule.objects.get_or_create(
                every=row["every"], period=IntervalSchedule.SECONDS)
        for field, key in (("start_time", "start_in"), ("expires", "expires_in")):
            if key in row:
                when[field] = now + dt.timedelta(seconds=row[key])
        PeriodicTask.objects.create(
            name=row["name"], task="t.tick", kwargs=json.dumps({"tag": row["name"]}),
            one_off=bool(row.get("one_off") or "clocked_in" in row),
            enabled=row.get("enabled", True), **when)


def rows() -> list[dict[str, Any]]:
    from django_celery_beat.models import PeriodicTask

    out = []
    for task in PeriodicTask.objects.order_by("name"):
        out.append({"name": task.name, "enabled": task.enabled,
                    "total_run_count": task.total_run_count,
                    "start_time": task.start_time and task.start_time.timestamp(),
                    "expires": task.expires and task.expires.timestamp(),
                    "clocked": task.clocked and task.clocked.clocked_time.timestamp()})
    return out


if __name__ == "__main__":
    if sys.argv[1] == "seed":
        seed(json.loads(sys.argv[2]))
    else:
        print(json.dumps(rows()))
