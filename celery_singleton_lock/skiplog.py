"""How a skipped duplicate shows in the worker's log: as a skip.

One INFO line of ours, ``Task t.charge[<id>] skipped: duplicate of <holder>
(running)``, whether or not task events are on; and not Celery's ``Task
t.charge[<id>] succeeded in ...: {'skipped': True, ...}`` line (nor, with
``-E``, its ``... ignored`` line), so lines counted from the log count runs.

Celery logs a task's end through the ``celery.app.trace`` logger, with the
line's fields in the record's ``data`` attribute ("for custom handlers", says
Celery). A filter on that logger drops that one line for the task id the
current thread (or greenlet) has just skipped, and no other.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from celery.app.trace import LOG_IGNORED, LOG_SUCCESS

#: the logger Celery's tracer writes a task's end to
TRACE_LOGGER = "celery.app.trace"
_ENDS = (LOG_SUCCESS, LOG_IGNORED.strip())
_skipping = threading.local()


class SkipLineFilter(logging.Filter):
    """Drops Celery's end-of-task line for the task this thread just skipped."""

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
#: how the line names the holder, by the skip's reason
_VERBS = {"done": "done by", "throttled": "throttled by", "replaced": "replaced by",
          "rate limited": "rate limited by"}


def log_skip(logger: logging.Logger, name: str, task_id: Optional[str],
             result: dict[str, Any]) -> None:
    """Log the skip of ``name[task_id]`` (its skip result ``result``) and keep
    Celery from logging it as a success."""
    trace = logging.getLogger(TRACE_LOGGER)
    if _FILTER not in trace.filters:
        trace.addFilter(_FILTER)
    _skipping.task_id = task_id
    if logger.isEnabledFor(logging.INFO):
        verb = _VERBS.get(result["reason"], "duplicate of")
        reopens = result.get("reopens_in")
        logger.info("Task %s[%s] skipped: %s %s (%s), key %s%s", name, task_id, verb,
                    result["holder"], result["state"], result["key"],
                    "" if reopens is None else f", the window reopens in {reopens:.1f} s")
