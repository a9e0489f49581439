"""``singleton_on_duplicate="replace"``: the caller's side of a send that took
the place of a call still queued.

``enqueue.lua`` moves the send-time key to the new task id and records each
superseded id in the key's ``replaced`` hash, where the worker finds it
(``acquire.lua``) and skips that message as ``"replaced"``. Here the caller
stores that same skip result for each superseded id at once, so their
``.get()`` returns without waiting for the old messages to reach a worker,
and gives the new message its debounce countdown.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from celery import states

from ..config import REPLACE, SingletonConfig
from ..observe import monitor
from ..observe.skiplog import naming
from .broker import schedulable
from .results import skip_result

logger = logging.getLogger("celery_singleton_lock")


def replace_args(config: SingletonConfig) -> Optional[tuple[int, int]]:
    """What ``enqueue.lua`` is given under ``replace``: (debounce ms, debounce_max ms)."""
    if config.on_duplicate != REPLACE:
        return None
    return int(config.debounce * 1000), int(config.debounce_max * 1000)


def debounced(app: Any, options: dict[str, Any], countdown_ms: Optional[int],
              config: SingletonConfig) -> dict[str, Any]:
    """The send's options with the debounce countdown the script gave (as the
    app's broker can carry it: :func:`.transport.schedulable`), unless the
    caller chose a countdown or an ETA of its own."""
    if not config.debounce or countdown_ms is None or (
            options.get("countdown") is not None or options.get("eta") is not None):
        return options
    return {**options, "countdown": schedulable(app, countdown_ms / 1000.0)}


def supersede(task: Any, key: str, successor: str, superseded: Sequence[str]) -> None:
    """Give each superseded task id its skip result now (naming ``successor``),
    log it, and tell a monitor (``task-skipped``, when this process sends
    task events)."""
    result = skip_result(key, successor, "replaced", "queued")
    store = not task.ignore_result
    for old in superseded:
        if store:
            try:
                # a stored success is never overwritten (Celery keeps the first):
                # one that named an earlier successor goes first
                task.backend.forget(old)
                task.backend.store_result(old, result, states.SUCCESS)
            except Exception as exc:  # no result backend, or it failed: the worker stores it
                logger.debug("Could not store the skip result of replaced %s[%s]: %r",
                             task.name, old, exc)
                store = False
        logger.info("Replaced %s[%s] by %s while queued, key %s", task.name, old, successor,
                    key)
        monitor.send_caller_event(task.app, "task-skipped", old, name=task.name,
                                  holder=successor, reason="replaced", key=key,
                                  result=naming("replaced", successor, key))
