"""The lock's facts on the task's OpenTelemetry span.

With OpenTelemetry in the worker (``opentelemetry-instrumentation-celery``
starts a span per task run and makes it current before the task's
``__call__``), each run's span carries:

==========================  ==========================================================
``singleton.key``           the lock key, ``<prefix>{<digest>}``
``singleton.key_digest``    the digest alone
``singleton.wait_ms``       how long taking the lock (or being refused) took
``singleton.outcome``       ``ran``, ``skipped``, ``retried`` (sent again to wait),
                            ``dropped`` (a late copy), ``failed`` (raised),
                            ``ran_unlocked`` (lock Redis down, policy ``run``)
``singleton.reason``        why, when it did not run under the lock (``duplicate``,
                            ``done``, ``throttled``, ``rate limited``, ``replaced``, ...)
``singleton.holder``        the task in the way (not run under the lock)
``singleton.token``         the fencing token (ran)
``singleton.slot``          the slot held under ``singleton_limit`` (ran)
==========================  ==========================================================

and a skip adds the event ``singleton.skipped`` (reason, holder, key) to the span.

Nothing is imported for this: the span is looked up only when the process
already loaded ``opentelemetry.trace`` (the instrumentation did), so a worker
without OpenTelemetry pays one dictionary look-up per run.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from ..keys import LockKeys

#: what each decision of :mod:`.policies` is called on the span
_OUTCOMES = {"skip": "skipped", "wait": "retried", "wait quietly": "retried",
             "drop": "dropped", "fail": "failed", "run unlocked": "ran_unlocked"}


def _span() -> Optional[Any]:
    """The current span when OpenTelemetry is loaded and it records, else None."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return None
    span = api.get_current_span()
    return span if span.is_recording() else None


def _key_facts(keys: LockKeys) -> dict[str, Any]:
    base = keys.base
    digest = base[base.find("{") + 1:base.rfind("}")] if "{" in base else base
    return {"singleton.key": base, "singleton.key_digest": digest}


def waited(keys: LockKeys, seconds: float) -> None:
    """The acquire's answer came after ``seconds``."""
    span = _span()
    if span is not None:
        span.set_attributes({**_key_facts(keys), "singleton.wait_ms": round(seconds * 1000, 3)})


def ran(keys: LockKeys, token: int, slot: int) -> None:
    """The body runs under the lock: its token and slot."""
    span = _span()
    if span is not None:
        span.set_attributes({**_key_facts(keys), "singleton.outcome": "ran",
                             "singleton.token": token, "singleton.slot": slot})


def decided(keys: LockKeys, decision: Any) -> None:
    """The execution does not run under its lock: what it gets, and why."""
    span = _span()
    if span is None:
        return
    outcome = _OUTCOMES.get(str(decision.do.value), str(decision.do.value))
    facts = {**_key_facts(keys), "singleton.outcome": outcome,
             "singleton.reason": decision.reason or ""}
    if decision.holder:
        facts["singleton.holder"] = decision.holder
    span.set_attributes(facts)
    if outcome == "skipped":
        span.add_event("singleton.skipped", {
            "singleton.reason": decision.reason or "", "singleton.holder": decision.holder or "",
            "singleton.key": keys.base})
