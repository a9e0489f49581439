"""A SingletonTask's messages in a canvas: whether a send is a canvas member,
a skipped member's links and chain, sent as Celery sends them after a
success, and when a message may start.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping, Optional

from celery import Task

#: send options that make a message a member of a canvas (a chord, a group, a link)
_CANVAS_OPTIONS = ("chord", "group_id", "link", "link_error")


def in_a_canvas(task_id: Optional[str], options: Mapping[str, Any]) -> bool:
    """A send that is part of a canvas: a chain's or group's member, a link,
    or the body of the chord of the task running here."""
    return ("chain" in options or any(options.get(o) for o in _CANVAS_OPTIONS)
            or _is_chord_body(task_id))


def _is_chord_body(task_id: Optional[str]) -> bool:
    """This send is the body of the chord of the task running here: Celery 5.3
    sends it with no canvas option at all (later ones add its group id)."""
    from celery import current_task

    body = getattr(getattr(current_task, "request", None), "chord", None)
    options = body.get("options") if isinstance(body, Mapping) else None
    return task_id is not None and isinstance(options, Mapping) and (
        options.get("task_id") == task_id)


def send_on(task: Task, result: Any, req: Any) -> None:
    """Send a skipped member's links and the rest of its chain, as Celery does
    after a success (``celery.app.trace``), with the skip result as input."""
    from celery import group
    from celery.canvas import maybe_signature

    app = task.app
    options = {"parent_id": req.id, "root_id": req.root_id or req.id}
    callbacks = [maybe_signature(sig, app=app) for sig in req.callbacks or ()]
    if len(callbacks) == 1:
        callbacks[0].apply_async((result,), **options)
    elif callbacks:
        groups = [sig for sig in callbacks if isinstance(sig, group)]
        for grp in groups:
            grp.apply_async((result,), **options)
        rest = [sig for sig in callbacks if not isinstance(sig, group)]
        if rest:
            group(rest, app=app).apply_async((result,), **options)
    if req.chain:
        chain = list(req.chain)
        maybe_signature(chain[-1], app=app).apply_async((result,), chain=chain[:-1], **options)


def send_delay(task: Task, options: dict[str, Any]) -> float:
    """Seconds until a message sent with these options may start."""
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            eta = None
    if isinstance(eta, dt.datetime):
        return delay_of(task, eta)
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return max(float(countdown), 0.0)
    return 0.0


def delay_of(task: Task, when: Any) -> float:
    if isinstance(when, dt.datetime):
        now = task.app.now() if when.tzinfo is not None else dt.datetime.now()
        return max((when - now).total_seconds(), 0.0)
    if isinstance(when, (int, float)):
        return float(when)
    return float(task.default_retry_delay or 0)
