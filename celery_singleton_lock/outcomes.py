"""What an execution that did not get its lock does, once :mod:`.policies`
has decided: skip (ending as SKIPPED in a monitor while its caller sees a
success), drop a redelivered copy, wait (the same request sent again after a
backoff), run without the lock, or fail.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional, Sequence

from celery.exceptions import Ignore, Retry

from . import monitor, policies, traces
from .canvas import send_on
from .config import SingletonConfig
from .engines import engine_for
from .exceptions import LockBackendError, WaitingForKey
from .keys import LockKeys
from .lock import REQUEST_ATTR, SingletonLock
from .policies import Decision, Do
from .results import skip_result
from .skiplog import log_skip
from .transport import schedulable, without_broker_headers

logger = logging.getLogger("celery_singleton_lock")

#: header counting how often a request was sent again to wait for its key
WAITS_HEADER = "singleton_waits"
#: how Flower's result of a skip names the holder, by the skip's reason
_RESULT_VERBS = {"done": "done by", "throttled": "throttled by", "replaced": "replaced by",
          "rate limited": "rate limited by"}


class Ended:
    """Returned up to the task's ``__call__`` by a skip that ends with ``Ignore``."""


#: Celery formats the traceback of an ``Ignore`` twice, each frame's source
#: line parsed again: raised in ``__call__``, it has the fewest frames to format
IGNORE = Ended()


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
        if backend_error is not None:
            logger.warning("Lock backend unavailable for %s[%s] (%r): retrying later",
                           name, task_id, backend_error)
        else:
            logger.info("Duplicate %s[%s] waits: %s is held by %s (%s)", name, task_id,
                        keys.base, decision.holder, decision.reason)
        try:
            sig, countdown = send_again(task, config, args, kwargs,
                                        backend_error=backend_error is not None,
                                        at=decision.reopens_in)
        except Exception as publish_exc:
            if backend_error is None:
                raise
            # Neither Redis nor the broker took it: fail loudly, never drop silently.
            raise LockBackendError(keys.base, f"{backend_error!r}; retry not sent: "
                                              f"{publish_exc!r}") from backend_error
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
        logger.warning("Lock backend unavailable for %s[%s] (%r): running WITHOUT the lock",
                       name, task_id, backend_error)
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
    verb = _RESULT_VERBS.get(result["reason"], "duplicate of")
    monitor.send_task_event(task, "task-skipped", holder=result["holder"],
                            reason=result["reason"], key=result["key"],
                            result=f"{verb} {result['holder']} ({result['key']})")
    return IGNORE  # raised as Ignore by __call__


def send_again(task: Any, config: SingletonConfig, args: Sequence[Any],
               kwargs: Mapping[str, Any], backend_error: bool = False,
               at: Optional[float] = None) -> tuple[Any, float]:
    """Send this very request again (same task id, same retries) after a
    backoff, or ``at`` seconds from now (a throttle window reopens then).

    The countdown is one the broker can carry (at least a second under
    RabbitMQ's native delayed delivery), and the message carries the headers Celery
    would put on a retry: the request's own, less the broker's bookkeeping
    (``x-death`` and the like, ``x-delivery-count``; :mod:`.transport`).
    """
    req = task.request
    waits = int(getattr(req, WAITS_HEADER, None) or 0)
    countdown = schedulable(task.app, policies.backoff(
        config, waits, backend_error=backend_error) if (
        at is None) else at + policies.THROTTLE_SLACK)
    headers = without_broker_headers(req.headers)
    headers[WAITS_HEADER] = waits + 1
    sig = task.signature_from_request(
        req, list(args), dict(kwargs), countdown=countdown, retries=req.retries,
        headers=headers)
    sig.apply_async()
    return sig, countdown
