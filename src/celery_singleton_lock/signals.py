"""Celery wiring in the main worker process: free what a dead child held.

A child killed by the OS, by a hard time limit or by ``revoke(terminate=True,
signal="SIGKILL")`` runs no code of ours. The main process learns of it from
these signals and frees the child's lock as soon as the child is gone, instead
of letting the lease run out. Handlers are thin, idempotent (Celery fires some
twice) and never block the worker's event loop: the wait for the child to exit
happens in a short-lived thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signals

logger = logging.getLogger("celery_singleton_lock")


def _reap_later(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    from .lock import engine_for
    from .task import SingletonTask

    if not isinstance(task, SingletonTask) or not task_id:
        return

    def reap() -> None:
        try:
            keys = task.singleton_keys(*(args or ()), **(kwargs or {}))
            engine_for(task.app).reap(keys, task_id)
        except Exception as exc:
            logger.warning("Could not free the singleton lock of %s[%s]: %r",
                           task.name, task_id, exc)

    threading.Thread(target=reap, name="singleton-reaper", daemon=True).start()


def on_task_failure(sender: Any = None, task_id: str = "", exception: Any = None,
                    args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        _reap_later(sender, task_id, args, kwargs)


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False,
                    **_: Any) -> None:
    if terminated and request is not None:
        _reap_later(sender, request.id, request.args, request.kwargs)


def connect() -> None:
    signals.task_failure.connect(on_task_failure, weak=False,
                                 dispatch_uid="celery_singleton_lock.failure")
    signals.task_revoked.connect(on_task_revoked, weak=False,
                                 dispatch_uid="celery_singleton_lock.revoked")
