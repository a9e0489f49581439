"""The Celery app of the beat tests: `celery beat` and `celery worker` both run it.

Configured from the environment like ``tests.workerapp`` (whose tasks it has
too), plus:

``SLT_BEAT_SCHEDULE``  JSON ``{name: {"task", "every" | "crontab", "kwargs", "options"}}``
                     (``crontab``: the minute field, or a dict of crontab's fields)
``SLT_CLOCK_OFFSET``   seconds added to this beat's clock (clock-skew tests)
``SLT_BEAT_NAME``      where this beat publishes ``singleton_stats`` (db 3, ``beatstats:<name>``)
``SLT_CURRENT_APP``    set: the app is made the current app, as a project's usually is

Tasks ``t.tick`` (plain), ``t.tick_hold`` and ``t.tick_cancellable``
(SingletonTasks) record the beat headers they arrive with in db 3 list ``events``.

A ``t.tick_hold`` whose ``key`` has ``prerun-hold:<key>`` set in db 3 records a
``prerun`` event and waits, before it asks for its lock, until that key is
deleted (a test kills its pool process there).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from typing import Any

from celery import Celery, signals
from celery.schedules import crontab

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.beat import SingletonScheduler
from celery_singleton_lock.worker.ticks import cancel_requested
from tests.workerapp import make_app, recorder

HEADERS = ("singleton_beat_entry", "singleton_beat_tick", "singleton_beat_id",
           "periodic_task_name", "celery_beat_task")


def make_beat_app(redis_url: str, queue: str, lock_url: str | None = None,
                  conf: dict[str, Any] | None = None,
                  schedule: dict[str, Any] | None = None) -> Celery:
    app = make_app(redis_url, queue, lock_url, conf)
    rec = recorder(redis_url)

    def record(task: Any, ev: str, **extra: Any) -> None:
        event = {h: getattr(task.request, h, None) for h in HEADERS}
        event.update(ev=ev, id=task.request.id, at=time.time(), pid=os.getpid(), **extra)
        rec.rpush("events", json.dumps(event))

    @app.task(bind=True, name="t.tick", shared=False)
    def tick(self: Any, tag: str = "") -> None:
        record(self, "tick", tag=tag)

    def hold(task: Any, key: str, seconds: float) -> None:
        n = rec.incr(f"active:{key}")
        record(task, "start", key=key, concurrent=n)
        try:
            time.sleep(seconds)
        finally:
            rec.decr(f"active:{key}")
            record(task, "end", key=key)

    @app.task(base=SingletonTask, bind=True, name="t.tick_hold", shared=False,
              singleton_key=("key",))
    def tick_hold(self: Any, key: str, seconds: float = 0.0) -> None:
        hold(self, key, seconds)

    @app.task(base=SingletonTask, bind=True, name="t.tick_wait", shared=False,
              singleton_key=("key",), singleton_on_duplicate="retry")
    def tick_wait(self: Any, key: str, seconds: float = 0.0) -> None:
        hold(self, key, seconds)

    @app.task(base=SingletonTask, bind=True, name="t.tick_cancellable", shared=False,
              singleton_key=("key",))
    def tick_cancellable(self: Any, key: str, seconds: float = 0.0) -> None:
        """Runs ``seconds`` unless asked to stop (overlap cancel_other) or terminated:
        ``finished`` only when it ran to the end, ``cancelled`` when asked, ``end`` always."""
        n = rec.incr(f"active:{key}")
        record(self, "start", key=key, concurrent=n)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if cancel_requested(self):
                    record(self, "cancelled", key=key)
                    return
                time.sleep(0.05)
            record(self, "finished", key=key)
        finally:
            rec.decr(f"active:{key}")
            record(self, "end", key=key)

    def hold_before_the_lock(sender: Any = None, task: Any = None, kwargs: Any = None,
                             **_: Any) -> None:
        key = (kwargs or {}).get("key")
        if (getattr(sender, "name", None) != "t.tick_hold" or not key
                or not rec.exists(f"prerun-hold:{key}")):
            return
        record(task, "prerun", key=key)
        deadline = time.monotonic() + 60
        while rec.exists(f"prerun-hold:{key}") and time.monotonic() < deadline:
            time.sleep(0.05)

    signals.task_prerun.connect(hold_before_the_lock, weak=False)

    entries: dict[str, Any] = {}
    for name, spec in (schedule or {}).items():
        entries[name] = {
            "task": spec["task"],
            "schedule": (_crontab(spec["crontab"]) if "crontab" in spec
                         else dt.timedelta(seconds=spec["every"])),
            "kwargs": spec.get("kwargs", {}),
            "options": spec.get("options", {}),
        }
    app.conf.beat_schedule = entries
    return app


def _crontab(spec: Any) -> crontab:
    """``"*/5"`` (the minute field) or ``{"minute": ..., "hour": ...}``."""
    return crontab(**spec) if isinstance(spec, dict) else crontab(minute=spec)


def publish_stats(scheduler: Any, published: dict[str, int]) -> dict[str, int]:
    """Write a beat's ``singleton_stats`` to db 3 ``beatstats:<SLT_BEAT_NAME>``
    when they changed since ``published``; returns what is published now."""
    stats = dict(scheduler.singleton_stats)
    if stats != published:
        name = os.environ.get("SLT_BEAT_NAME") or scheduler.beat_id
        client = recorder(os.environ["SLT_REDIS_URL"])
        client.hset(f"beatstats:{name}", mapping={"beat_id": scheduler.beat_id, **stats})
        client.close()
    return stats


class RecordingScheduler(SingletonScheduler):
    """The library's scheduler with a shifted clock, publishing its counters."""

    offset = dt.timedelta(seconds=float(os.environ.get("SLT_CLOCK_OFFSET") or 0))
    _published: dict[str, int] = {}  # noqa: RUF012 - replaced per instance on first publish

    def singleton_now(self) -> dt.datetime:
        return super().singleton_now() + self.offset

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay = super().tick(*args, **kwargs)
        self._published = publish_stats(self, self._published)
        return delay


def _from_env() -> Celery:
    app = make_beat_app(
        os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
        os.environ.get("SLT_QUEUE", "celery"),
        os.environ.get("SLT_LOCK_URL") or None,
        json.loads(os.environ.get("SLT_CONF") or "{}"),
        json.loads(os.environ.get("SLT_BEAT_SCHEDULE") or "{}"),
    )
    if os.environ.get("SLT_CURRENT_APP"):
        app.set_current()  # as a project's app is (Celery's default): schedules read its zone
    return app


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = _from_env()
        globals()["app"] = app
        return app
    raise AttributeError(name)
