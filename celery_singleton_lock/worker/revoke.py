"""The ``revoke`` remote control command, watched so queued keys free at once.

Celery fires ``task_revoked`` for a message it holds for a later ETA only
when that ETA comes; the send-time key of a revoked task must free now. The
command is wrapped once per process: it runs as before, then frees the
send-time keys of the revoked tasks this worker holds unstarted.

Celery 5.4 and later register such a message in the worker's state when it
arrives; Celery 5.3 keeps it only in the consumer's timer, where it is looked
up then.
"""

from __future__ import annotations

from typing import Any, Optional

from .signals import free_queued_later


def _timed_request(state: Any, task_id: str) -> Optional[Any]:
    """The request of ``task_id`` waiting in the consumer's timer for its ETA."""
    timer = getattr(getattr(state, "consumer", None), "timer", None)
    try:
        scheduled = list(timer.queue) if timer is not None else []
    except Exception:  # another timer: nothing to find there
        return None
    for item in scheduled:
        entry = item[-1] if isinstance(item, tuple) else item
        for arg in getattr(entry, "args", None) or ():
            if getattr(arg, "id", None) == task_id and hasattr(arg, "task"):
                return arg
    return None


def watch_revoke_command() -> None:
    from celery.worker import control
    from celery.worker import state as worker_state

    original = control.Panel.data.get("revoke")
    if original is None or getattr(original, "_singleton_watched", False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(state, task_id, *args, **kwargs)
        ids = task_id if isinstance(task_id, (list, tuple, set)) else [task_id]
        for tid in ids:
            request = worker_state.requests.get(tid) or _timed_request(state, tid)
            if request is not None and request not in worker_state.active_requests:
                free_queued_later(request.task, tid, request.args, request.kwargs)
        return reply

    revoke._singleton_watched = True  # type: ignore[attr-defined]
    control.Panel.data["revoke"] = revoke
