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


def _in_thread(name: str, work: Any) -> None:
    threading.Thread(target=work, name=name, daemon=True).start()


def free_queued_later(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """Free the send-time key of a task that will now never start (revoked, expired)."""
    from .lock import engine_for
    from .task import SingletonTask

    if not isinstance(task, SingletonTask) or not task_id:
        return

    def free() -> None:
        try:
            if task.singleton_settings().scope == "run":
                return
            keys = task.singleton_keys(*(args or ()), **(kwargs or {}))
            if engine_for(task.app).unqueue(keys, task_id):
                logger.info("Freed the key %s of revoked %s[%s]", keys.base, task.name, task_id)
        except Exception as exc:
            logger.warning("Could not free the send-time key of %s[%s]: %r",
                           task.name, task_id, exc)

    _in_thread("singleton-unqueue", free)


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

    _in_thread("singleton-reaper", reap)


def on_task_failure(sender: Any = None, task_id: str = "", exception: Any = None,
                    args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        _reap_later(sender, task_id, args, kwargs)


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False,
                    **_: Any) -> None:
    if request is None:
        return
    if terminated:
        _reap_later(sender, request.id, request.args, request.kwargs)
    else:
        free_queued_later(sender, request.id, request.args, request.kwargs)


def watch_revoke_command() -> None:
    """Free queued keys as soon as a revoke reaches this worker.

    Celery fires ``task_revoked`` for a message it holds for a later ETA only
    when that ETA comes; the key of a revoked task must free now. The ``revoke``
    remote control command is wrapped once per process: it runs as before, then
    frees the send-time keys of the revoked tasks this worker holds unstarted.
    """
    from celery.worker import control
    from celery.worker import state as worker_state

    original = control.Panel.data.get("revoke")
    if original is None or getattr(original, "_singleton_watched", False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        ids = task_id if isinstance(task_id, (list, tuple, set)) else [task_id]
        for tid in ids:
            request = worker_state.requests.get(tid)
            if request is not None and request not in worker_state.active_requests:
                free_queued_later(request.task, tid, request.args, request.kwargs)
        return reply

    revoke._singleton_watched = True  # type: ignore[attr-defined]
    control.Panel.data["revoke"] = revoke


def on_process_shutdown(**_: Any) -> None:
    """A pool process exits without running atexit: read the replies it is owed."""
    from .lock import settle_all

    settle_all()


def connect() -> None:
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=False,
                                            dispatch_uid="celery_singleton_lock.process_shutdown")
    signals.task_failure.connect(on_task_failure, weak=False,
                                 dispatch_uid="celery_singleton_lock.failure")
    signals.task_revoked.connect(on_task_revoked, weak=False,
                                 dispatch_uid="celery_singleton_lock.revoked")
