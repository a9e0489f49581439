"""Celery signals: free what a dead child held, read owed replies at exit.

A child killed by the OS, by a hard time limit or by ``revoke(terminate=True,
signal="SIGKILL")`` runs no code of ours. The main worker process learns of it
from these signals and frees the child's lock as soon as the child is gone,
instead of letting the lease run out. Handlers are thin, idempotent (Celery
fires some twice) and never block the worker's event loop: the wait for the
child to exit happens in a short-lived thread.

:func:`connect` is called by the worker step (:mod:`.step`) when a worker
of an app with a singleton task starts, never on import.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signals

from ..engine.registry import engine_for, settle_all
from ..exceptions import describe
from ..worker.ticks import BEAT_HEADERS_READ, decide_lost_tick_run

logger = logging.getLogger("celery_singleton_lock")


def is_singleton(task: Any) -> bool:
    """A task built on SingletonTask (told by what it offers, so this module
    needs no import of the task class: wiring flows one way)."""
    return callable(getattr(task, "singleton_keys", None))


def _in_thread(name: str, work: Callable[[], None]) -> None:
    threading.Thread(target=work, name=name, daemon=True).start()


def free_queued_later(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """Free the send-time key of a task that will now never start (revoked, expired)."""
    if not is_singleton(task) or not task_id:
        return

    def free() -> None:
        try:
            if task.singleton_settings().config.scope == "run":
                return
            keys = task.singleton_keys(*(args or ()), **(kwargs or {}))
            if engine_for(task.app).unqueue(keys, task_id):
                logger.info("Freed the key %s of revoked %s[%s]", keys.base, task.name, task_id)
        except Exception as exc:
            logger.warning("Could not free the send-time key of %s[%s]: %s",
                           task.name, task_id, describe(exc))

    _in_thread("singleton-unqueue", free)


def _beat_headers(request: Any) -> dict[str, Any]:
    """What :func:`.ticks.decide_lost_tick_run` reads of a request, copied in the
    signal's own thread (a task's request stack is local to its thread)."""
    fields = getattr(request, "request_dict", None)  # a worker Request: its message's headers
    if isinstance(fields, dict):
        read = {name: fields.get(name) for name in BEAT_HEADERS_READ}
    else:
        read = {name: getattr(request, name, None) for name in BEAT_HEADERS_READ}
    return read if read[BEAT_HEADERS_READ[0]] else {}


def _reap_later(task: Any, task_id: str, args: Any, kwargs: Any,
                request: Any = None) -> None:
    if not is_singleton(task) or not task_id:
        return
    tick = _beat_headers(request)

    def reap() -> None:
        try:
            if tick:
                # before the lock is freed: a free lock beside this tick's
                # marker is what tells beat's buffer_all the tick is over
                decide_lost_tick_run(engine_for(task.app),
                                     task.singleton_settings().config.key_prefix, tick)
            keys = task.singleton_keys(*(args or ()), **(kwargs or {}))
            engine_for(task.app).reap(keys, task_id,
                                      slots=task.singleton_settings().config.limit)
        except Exception as exc:
            logger.warning("Could not free the singleton lock of %s[%s]: %s",
                           task.name, task_id, describe(exc))

    _in_thread("singleton-reaper", reap)


def on_task_failure(sender: Any = None, task_id: str = "", exception: Any = None,
                    args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        # Celery puts the lost task's request on its stack for this signal
        _reap_later(sender, task_id, args, kwargs, getattr(sender, "request", None))


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False,
                    **_: Any) -> None:
    if request is None:
        return
    if terminated:
        _reap_later(sender, request.id, request.args, request.kwargs, request)
    else:
        free_queued_later(sender, request.id, request.args, request.kwargs)


def on_process_shutdown(**_: Any) -> None:
    """A pool process exits without running atexit: read the replies it is owed."""
    settle_all()


def connect() -> None:
    """Connect every handler (once; safe to call again)."""
    signals.worker_process_shutdown.connect(on_process_shutdown, weak=False,
                                            dispatch_uid="celery_singleton_lock.process_shutdown")
    signals.task_failure.connect(on_task_failure, weak=False,
                                 dispatch_uid="celery_singleton_lock.failure")
    signals.task_revoked.connect(on_task_revoked, weak=False,
                                 dispatch_uid="celery_singleton_lock.revoked")
