"""A rate limit per key: at most N starts of one key in any window (``singleton_rate``).

``singleton_rate = "10/m"``: at most 10 executions of one key start within any
60 s, across every worker of the fleet (Celery's own ``rate_limit`` counts per
worker, for the task as a whole). The window slides: each start is kept, by its
task id and the lock Redis's own clock, in the key's ``rate`` sorted set for
one window, and a start is granted only while fewer than N are there
(``lua/acquire.lua``, ``lua/acquire_slots.lua``, in the same script as the
lock: nothing slips in between). A task's own retry (the same task id) is the
same start and is not counted again.

A call over the limit gets what ``singleton_on_duplicate`` says (:func:`decide`):
``skip`` (and ``replace``) skips it, its result saying when the window reopens;
``retry`` sends it again for the moment the window reopens (the oldest start
in it leaves), never sooner; ``raise`` fails it. With ``singleton_limit`` N > 1
both hold: at most N running at once and at most M starts in a window.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from .exceptions import ConfigurationError, DuplicateTaskError
from .policies import Decision, Do
from .replies import Acquired

#: seconds of each unit a rate may be given in
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smhd])\s*$")
#: the reason a skip or a wait gives (skip results, logs, metrics)
REASON = "rate limited"


@functools.lru_cache(maxsize=256)
def parse(text: str) -> tuple[int, int]:
    """``"10/m"``, ``"100/30s"``, ``"5/2h"`` as (starts, window in ms); raises ValueError."""
    found = _RATE.match(text)
    if found is None:
        raise ValueError(text)
    count, amount, unit = found.groups()
    window_ms = round(float(amount or 1) * _UNITS[unit] * 1000)
    if int(count) < 1 or window_ms < 1:
        raise ValueError(text)
    return int(count), window_ms


def check_rate(setting: str, value: object) -> str:
    """The setting's check: a string ``"<starts>/<window>"`` (``""``: no limit)."""
    if value == "":
        return ""
    if isinstance(value, str):
        try:
            parse(value)
            return value.strip()
        except ValueError:
            pass
    raise ConfigurationError(
        setting, f"expected '<starts>/<window>' such as '10/m', '100/30s' or '5/2h' "
                 f"(at most that many starts of one key in any such window, across "
                 f"every worker), got {value!r}")


def uses_rate(app: Any) -> bool:
    """The app sets ``singleton_rate``, or one of its tasks does: the worker's
    start-up check then tries the rate-limited acquire too (its commands)."""
    if app.conf.get("singleton_rate"):
        return True
    return any(getattr(task, "singleton_rate", None) for task in app.tasks.values())


def rate_option(text: str) -> dict[str, tuple[int, int]]:
    """The engine's ``rate`` argument, (starts, window ms); none without a limit."""
    return {"rate": parse(text)} if text else {}


def decide(answer: Acquired, *, on_duplicate: str, task_name: str, key: str) -> Decision:
    """An execution over its key's rate limit: skip, or wait until the window
    reopens (``reopens_in``, the countdown of the send again), or fail."""
    holder = answer.holder.task_id if answer.holder is not None else None
    reopens = answer.reopens_ms / 1000.0
    if on_duplicate in ("skip", "replace"):
        return Decision(Do.SKIP, holder=holder, reason=REASON, reopens_in=reopens,
                        state="started")
    if on_duplicate == "retry":
        return Decision(Do.WAIT, holder=holder, reason=REASON, reopens_in=reopens,
                        state="started")
    return Decision(Do.FAIL, holder=holder, reason=REASON, reopens_in=reopens, state="started",
                    error=DuplicateTaskError(task_name, key, holder, "started"))
