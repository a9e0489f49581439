"""Beat without a leader: any number of ``celery beat`` processes, each tick sent once."""

from __future__ import annotations

from .scheduler import SingletonScheduler, SingletonSchedulerMixin

__all__ = ["SingletonScheduler", "SingletonSchedulerMixin"]
