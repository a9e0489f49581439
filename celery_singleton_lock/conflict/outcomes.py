"""What a duplicate gets, carried out once :mod:`.policies` has decided.

At run (:func:`carry_out`), an execution that did not get its lock: skip
(ending as SKIPPED in a monitor while its caller sees a success), drop a
redelivered copy, wait (the same request sent again after a backoff), run
without the lock, or fail. At send (:func:`carry_out_at_send`), a send under
the queue scopes (or a rollout's) that found its key taken: refused (the
caller gets the holder's result) or failed.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from celery.exceptions import Ignore, Retry

from ..config import SingletonConfig
from ..engine.registry import engine_for
from ..exceptions import LockBackendError, WaitingForKey, describe
from ..keys import LockKeys
from ..lock import REQUEST_ATTR, SingletonLock
from ..observe import monitor, traces
from ..observe.skiplog import log_skip, log_wait, naming
from . import policies
from .broker import schedulable, without_broker_headers
from .canvas import send_on
from .policies import Decision, Do
from .results import DeduplicatedResult, skip_result

logger = logging.getLogger("celery_singleton_lock")

#: header counting how often a request was sent again to wait for its key
WAITS_HEADER = "singleton_waits"
#: header of a request sent again: how far the lock Redis's clock was ahead of
#: its sender's (seconds), so the worker that reads its ETA times it on that clock
CLOCK_HEADER = "singleton_clock"


class Ended:
    """Returned up to the task's ``__call__`` by a skip that ends with ``Ignore``."""


#: Celery formats the traceback of an ``Ignore`` twice, each frame's source
#: line parsed again: raised in ``__call__``, it has the fewest frames to format
IGNORE = Ended()


def carry_out_at_send(task: Any, decision: Decision, key: str, task_id: str,
                      engine: Any) -> Optional[DeduplicatedResult]:
    """Do what :mod:`.policies` decided for a send that found its key taken:
    raise, or refuse (no message; the caller gets the holder's result, a
    counter and a ``task-refused`` event say so). None: send it."""
    if decision.do is Do.FAIL:
        assert decision.error is not None
        raise decision.error
    if decision.do is not Do.REFUSE:
        return None
    assert decision.holder is not None
    logger.info("Not sent %s[%s]: %s is %s by %s", task.name, task_id, key,
                "done" if decision.reason == "done" else "taken", decision.holder)
    # visible to operators: a counter, and a task-refused event (Flower state
    # REFUSED) when this caller sends task events
    monitor.count(engine, "refused", task.name, decision.reason)
    monitor.send_caller_event(
        task.app, "task-refused", task_id, name=task.name, holder=decision.holder,
        reason=decision.reason, key=key, result=naming(decision.reason, decision.holder, key))
    return DeduplicatedResult(decision.holder, key=key, reason=decision.reason,
                              refused_id=task_id, task=task)


def carry_out(task: Any, decision: Decision, config: SingletonConfig, keys: LockKeys,
              args: Sequence[Any], kwargs: Mapping[str, Any],
              backend_error: Optional[Exception] = None) -> Any:
    """Do what :mod:`.policies` decided for an execution that did not get its lock."""
    req = task.request
    name, task_id, do = task.name, req.id, decision.do
    traces.decided(keys, decision)  # on the task's span, with OpenTelemetry
    if do is Do.SKIP:
        skipped = skip_result(keys.base, decision.holder, decision.reason, decision.state,
                              decision.reopens_in)
        log_skip(logger, name, task_id, skipped)  # and not as Celery's "succeeded"
        monitor.count(engine_for(task.app), "skipped", name, decision.reason)
        return end_skipped(task, req, skipped)
    if do is Do.DROP:
        logger.info("Dropped redelivered %s[%s]: %s", name, task_id, decision.reason)
        raise Ignore()
    if do is Do.WAIT_QUIETLY:
        logger.info("Redelivered %s[%s] waits for %s (%s)", name, task_id, decision.reason,
                    decision.holder)
        send_again(task, config, args, kwargs)
        raise Ignore()
    if do is Do.WAIT:
        try:
            sig, countdown = send_again(task, config, args, kwargs,
                                        backend_error=backend_error is not None,
                                        at=decision.reopens_in)
        except Exception as publish_exc:
            if backend_error is None:
                raise
            # Neither Redis nor the broker took it: fail loudly, never drop silently.
            raise LockBackendError(keys.base, f"{describe(backend_error)}; retry not sent: "
                                              f"{describe(publish_exc)}") from backend_error
        # one line per round, ours (Celery's "retry:" line for it is dropped)
        log_wait(logger, name, task_id, keys.base, decision, countdown, backend_error)
        why = decision.reason if backend_error is not None else (
            f"{keys.base} is held by {decision.holder}")
        if backend_error is not None:
            raise Retry(why, when=countdown, sig=sig)
        monitor.count(engine_for(task.app), "waited", name)
        # The reason Celery records for the RETRY (Flower's "exception"):
        # that it waits, and for whom.
        raise Retry(why, exc=WaitingForKey(name, keys.base, decision.holder),
                    when=countdown, sig=sig)
    if do is Do.RUN_UNLOCKED:
        logger.warning("Lock backend unavailable for %s[%s] (%s): running WITHOUT the lock",
                       name, task_id, describe(backend_error))
        setattr(req, REQUEST_ATTR, SingletonLock(keys, task_id=task_id, task_name=name))
        return task.run(*args, **kwargs)
    assert do is Do.FAIL and decision.error is not None, decision
    raise decision.error


def end_skipped(task: Any, req: Any, result: dict[str, Any]) -> Any:
    """End a skipped duplicate so that Flower shows it as SKIPPED while its
    caller, its chain and its chord see an ordinary success.

    The result is stored here (``.get()`` returns it at once; a chord
    counts the member done), the chain and links it belongs to are sent on
    with it, a ``task-skipped`` event carries holder, reason and key, and
    ``Ignore`` ends the run: a ``task-succeeded`` would outrank SKIPPED.

    Only when the worker sends task events (``-E``): with none, no monitor
    can show a state, and Celery's handling of ``Ignore`` (it formats the
    traceback twice) costs about 4 ms of CPU per skip, where returning the
    result costs a tenth of that. Without a worker (``apply()``) the result
    is simply returned too.
    """
    if req.is_eager or req.called_directly or not req.id or not (
            monitor.worker_events_on(task)):
        return result
    ignored = getattr(req, "ignore_result", None)
    if ignored is None:
        ignored = task.ignore_result
    if req.callbacks or req.chain:
        send_on(task, result, req)
    task.backend.mark_as_done(req.id, result, request=req, store_result=not ignored)
    # "result" is the field Flower shows on the task row and page
    monitor.send_task_event(task, "task-skipped", holder=result["holder"],
                            reason=result["reason"], key=result["key"],
                            result=naming(result["reason"], result["holder"], result["key"]))
    return IGNORE  # raised as Ignore by __call__


def send_again(task: Any, config: SingletonConfig, args: Sequence[Any],
               kwargs: Mapping[str, Any], backend_error: bool = False,
               at: Optional[float] = None) -> tuple[Any, float]:
    """Send this very request again (same task id, same retries) after a
    backoff, or ``at`` seconds from now (a throttle window reopens then).

    The countdown is one the broker can carry (at least a second under
    RabbitMQ's native delayed delivery), and the message carries the headers Celery
    would put on a retry: the request's own, less the broker's bookkeeping
    (``x-death`` and the like, ``x-delivery-count``; :mod:`.broker`).
    """
    req = task.request
    waits = int(getattr(req, WAITS_HEADER, None) or 0)
    countdown = schedulable(task.app, policies.backoff(
        config, waits, backend_error=backend_error) if (
        at is None) else at + policies.THROTTLE_SLACK)
    headers = without_broker_headers(req.headers)
    headers[WAITS_HEADER] = waits + 1
    # Celery writes the countdown as an ETA on this host's clock, and the
    # worker that reads it times it on its own: with this host's offset from
    # the lock Redis's clock, that worker times it on the lock Redis's
    # (worker.step.SingletonRequest), whatever either host's clock says
    offset = engine_for(task.app).clock_offset()
    if offset is not None:
        headers[CLOCK_HEADER] = round(offset, 6)
    else:
        headers.pop(CLOCK_HEADER, None)
    sig = task.signature_from_request(
        req, list(args), dict(kwargs), countdown=countdown, retries=req.retries,
        headers=headers)
    sig.apply_async()
    return sig, countdown
