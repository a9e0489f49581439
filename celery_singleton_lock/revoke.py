"""The ``revoke`` remote control command, watched so queued keys free at once.

Celery fires ``task_revoked`` for a message it holds for a later ETA only
when that ETA comes; the send-time key of a revoked task must free now. The
command is wrapped once per process: it runs as before, then frees the
send-time keys of the revoked tasks this worker holds unstarted.
"""

from __future__ import annotations

from typing import Any

from .signals import free_queued_later


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
            request = worker_state.requests.get(tid)
            if request is not None and request not in worker_state.active_requests:
                free_queued_later(request.task, tid, request.args, request.kwargs)
        return reply

    revoke._singleton_watched = True  # type: ignore[attr-defined]
    control.Panel.data["revoke"] = revoke
