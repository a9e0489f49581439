"""What a SingletonTask's messages carry on: a skipped member's links and chain,
sent as Celery sends them after a success, and when a message may start.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from celery import Task


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
