"""The app and scheduler of :mod:`benchmarks.beatwindow`: django-celery-beat's
``DatabaseScheduler`` on PostgreSQL under ``SingletonSchedulerMixin``, timing,
for each tick this beat claims, the claim's round trip and the moment the
publish returned.

``celery -A benchmarks.beatwindowapp:app beat -S benchmarks.beatwindowapp:TimedScheduler``;
``python -m benchmarks.beatwindowapp seed N`` migrates the database and writes
N interval rows of 1 s. Configured from the environment: ``BW_PG_DSN`` (the
database, as libpq key=value pairs), ``BW_REDIS_URL`` (broker on db 0, locks
on db 2), ``BW_RECORD`` (the file each beat appends its timings to).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import django
from django.conf import settings

_DSN = dict(part.split("=", 1) for part in os.environ.get("BW_PG_DSN", "").split())
settings.configure(
    INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql",
                           "NAME": _DSN.get("dbname", "postgres"),
                           "HOST": _DSN.get("host", "127.0.0.1"),
                           "PORT": _DSN.get("port", "5432"),
                           "USER": _DSN.get("user", "postgres")}},
)
django.setup()

from celery import Celery  # noqa: E402
from django_celery_beat.schedulers import DatabaseScheduler  # noqa: E402

from celery_singleton_lock.beat import SingletonSchedulerMixin  # noqa: E402

_REDIS = os.environ.get("BW_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
app = Celery("beatwindow", broker=f"{_REDIS}/0", set_as_current=False)
app.conf.singleton_redis_url = f"{_REDIS}/2"
app.conf.task_default_queue = "beatwindow"


@app.task(name="bw.noop")
def noop() -> None:
    """Never run: the benchmark starts no worker, it times the beat's send."""


class _PublishTimed(DatabaseScheduler):  # type: ignore[misc]
    """Below the mixin: notes when Celery's publish of the message returned
    (before the mixin counts the run in the database)."""

    published_at = 0.0

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        result = super().apply_async(entry, producer, advance, **kwargs)
        self.published_at = time.perf_counter()
        return result


class TimedScheduler(SingletonSchedulerMixin, _PublishTimed):
    """Each tick this beat claims: when the claim was asked and answered and,
    for a tick it sent, when the publish returned (``time.perf_counter``, one
    process's clock: only differences are written)."""

    _timing: Optional[tuple[str, float, float]] = None

    def _claim(self, entry: Any, tick: Any) -> bool:
        asked = time.perf_counter()
        won = bool(super()._claim(entry, tick))
        answered = time.perf_counter()
        if won:
            self.published_at = 0.0
            self._timing = (entry.name, asked, answered)
        return won

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True,
                    **kwargs: Any) -> Any:
        result = super().apply_async(entry, producer, advance, **kwargs)
        timing = self._timing
        if timing is not None and timing[0] == entry.name and self.published_at:
            _, asked, answered = timing
            line = json.dumps({"entry": entry.name, "beat": self.beat_id,
                               "claim_ms": (answered - asked) * 1000,
                               "window_ms": (self.published_at - answered) * 1000}) + "\n"
            fd = os.open(os.environ["BW_RECORD"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
            self._timing = None
        return result


def seed(count: int) -> None:
    from django.core.management import call_command
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    call_command("migrate", "django_celery_beat", verbosity=0)
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    for n in range(count):
        PeriodicTask.objects.create(name=f"row-{n}", task="bw.noop", interval=every)


if __name__ == "__main__":
    seed(int(sys.argv[2]))
