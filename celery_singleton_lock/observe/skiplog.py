"""How a duplicate that did not run shows in the worker's log: as a skip, or
as a wait, in one line of ours.

A skip is one INFO line, ``Task t.charge[<id>] skipped: duplicate of <holder>
(running)``, whether or not task events are on; and not Celery's ``Task
t.charge[<id>] succeeded in ...: {'skipped': True, ...}`` line (nor, with
``-E``, its ``... ignored`` line), so lines counted from the log count runs.

A wait (the ``retry`` policy, or the lock Redis not answering) is one line per
round, ``Task t.charge[<id>] waits: duplicate of <holder> (running), key ...;
sent again in 0.4 s``, and not Celery's ``Task t.charge[<id>] retry: ...``
line beside it.

Celery logs a task's end through the ``celery.app.trace`` logger, with the
line's fields in the record's ``data`` attribute ("for custom handlers", says
Celery). A filter on that logger drops that one line for the task id the
current thread (or greenlet) has just skipped or sent again, and no other.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from celery.app.trace import LOG_IGNORED, LOG_RETRY, LOG_SUCCESS

from ..exceptions import describe

#: the logger Celery's tracer writes a task's end to
TRACE_LOGGER = "celery.app.trace"
_ENDS = (LOG_SUCCESS, LOG_IGNORED.strip(), LOG_RETRY)
_skipping = threading.local()


class SkipLineFilter(logging.Filter):
    """Drops Celery's end-of-task line for the task this thread just skipped or
    sent again to wait."""

    def filter(self, record: logging.LogRecord) -> bool:
        task_id: Optional[str] = getattr(_skipping, "task_id", None)
        if task_id is None or record.msg not in _ENDS:
            return True
        data = getattr(record, "data", None)
        if isinstance(data, dict) and data.get("id") == task_id:
            _skipping.task_id = None
            return False
        return True


_FILTER = SkipLineFilter()

#: how a skip or a refusal names the holder, by its reason: the one table the
#: log, Flower's result column and the caller's events all read
VERBS = {"duplicate": "duplicate of", "done": "done by", "throttled": "throttled by",
         "replaced": "replaced by", "rate limited": "rate limited by"}


def naming(reason: str, holder: object, key: str) -> str:
    """``done by <holder> (<key>)``: the holder, named for ``reason``."""
    return f"{VERBS.get(reason, VERBS['duplicate'])} {holder} ({key})"


def _quiet_celery_line(task_id: Optional[str]) -> None:
    """Drop Celery's next end-of-task line for ``task_id`` in this thread."""
    trace = logging.getLogger(TRACE_LOGGER)
    if _FILTER not in trace.filters:
        trace.addFilter(_FILTER)
    _skipping.task_id = task_id


def log_skip(logger: logging.Logger, name: str, task_id: Optional[str],
             result: dict[str, Any]) -> None:
    """Log the skip of ``name[task_id]`` (its skip result ``result``) and keep
    Celery from logging it as a success."""
    _quiet_celery_line(task_id)
    if logger.isEnabledFor(logging.INFO):
        verb = VERBS.get(result["reason"], VERBS["duplicate"])
        reopens = result.get("reopens_in")
        logger.info("Task %s[%s] skipped: %s %s (%s), key %s%s", name, task_id, verb,
                    result["holder"], result["state"], result["key"],
                    "" if reopens is None else f", the window reopens in {reopens:.1f} s")


def log_wait(logger: logging.Logger, name: str, task_id: Optional[str], key: str,
             decision: Any, countdown: float, backend_error: Optional[BaseException]) -> None:
    """Log that ``name[task_id]`` was sent again to wait (``decision``, a
    :class:`.policies.Decision` of ``Do.WAIT``), in ``countdown`` seconds, and
    keep Celery from logging the same round as its retry.

    The lock Redis not answering is a WARNING (no lock can be had); a duplicate
    waiting for its holder is the ``retry`` policy doing its work: INFO."""
    _quiet_celery_line(task_id)
    when = f"sent again in {countdown:.1f} s"
    if backend_error is not None:
        logger.warning("Lock backend unavailable for %s[%s] (%s): %s", name, task_id,
                       describe(backend_error), when)
        return
    if not logger.isEnabledFor(logging.INFO):
        return
    holder, reason = decision.holder, decision.reason
    if reason == "throttled":
        why = f"throttled by {holder}, key {key}; {when}, as its window reopens"
    elif reason == "duplicate":
        state = f" ({decision.state})" if decision.state else ""
        why = f"duplicate of {holder}{state}, key {key}; {when}"
    elif reason.startswith("accepted when sent"):  # it runs, after the one holding the key
        why = f"{key} is held by {holder}; accepted when sent, this call waits its turn; {when}"
    else:  # a holder not renewed on time, say: decided by then
        why = f"{key} is held by {holder} ({reason}); {when}"
    logger.info("Task %s[%s] waits: %s", name, task_id, why)
