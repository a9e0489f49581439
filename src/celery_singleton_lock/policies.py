"""What a task gets when its key is taken, or when Redis cannot be reached.

Each policy is a small function in a registry, named as users write it in
``singleton_on_duplicate`` and ``singleton_on_backend_error``.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from celery.exceptions import Ignore, Retry

from .exceptions import DuplicateTaskError, LockBackendError
from .keys import LockKeys
from .lock import Holder

if TYPE_CHECKING:
    from .task import SingletonTask, TaskSettings

logger = logging.getLogger("celery_singleton_lock")

WAITS_HEADER = "singleton_waits"


def skip_result(key: str, holder: str | None, reason: str = "duplicate") -> dict[str, Any]:
    """The result a skipped duplicate returns (plain JSON)."""
    return {"skipped": True, "holder": holder, "key": key, "reason": reason}


def is_skipped(result: Any) -> bool:
    """True when ``result`` is what a skipped duplicate returned."""
    return isinstance(result, dict) and result.get("skipped") is True and "holder" in result


def backoff(task: SingletonTask, settings: TaskSettings) -> tuple[float, int]:
    """The next countdown for a task that waits, and its wait count."""
    waits = int(getattr(task.request, WAITS_HEADER, None) or 0)
    delay = min(settings.retry_delay * (2 ** min(waits, 30)), settings.retry_max_delay)
    return delay * random.uniform(0.8, 1.2), waits + 1


def republish(
    task: SingletonTask,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    countdown: float,
    waits: int,
) -> Any:
    """Send this very request again (same task id, same retries) after ``countdown``."""
    req = task.request
    headers = dict(req.headers or {}) if isinstance(req.headers, dict) else {}
    headers[WAITS_HEADER] = waits
    sig = task.signature_from_request(
        req, list(args), dict(kwargs), countdown=countdown, retries=req.retries, headers=headers
    )
    sig.apply_async()
    return sig


def _wait(task: SingletonTask, settings: TaskSettings, args: Sequence[Any],
          kwargs: Mapping[str, Any], why: str) -> Retry:
    countdown, waits = backoff(task, settings)
    sig = republish(task, args, kwargs, countdown, waits)
    return Retry(why, when=countdown, sig=sig)


# -- duplicates -------------------------------------------------------------

def skip_done(task: SingletonTask, keys: LockKeys, holder: Holder) -> Any:
    """Within ``singleton_done_ttl`` of a success every duplicate is skipped."""
    logger.info(
        "Skipped duplicate %s[%s]: %s was done by %s",
        task.name, task.request.id, keys.base, holder.task_id,
    )
    return skip_result(keys.base, holder.task_id, reason="done")


def _dup_skip(task: SingletonTask, settings: TaskSettings, keys: LockKeys, holder: Holder,
              args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    logger.info(
        "Skipped duplicate %s[%s]: %s is held by %s",
        task.name, task.request.id, keys.base, holder.task_id,
    )
    return skip_result(keys.base, holder.task_id)


def _dup_retry(task: SingletonTask, settings: TaskSettings, keys: LockKeys, holder: Holder,
               args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    logger.info(
        "Duplicate %s[%s] waits: %s is held by %s",
        task.name, task.request.id, keys.base, holder.task_id,
    )
    raise _wait(task, settings, args, kwargs, f"{keys.base} is held by {holder.task_id}")


def _dup_raise(task: SingletonTask, settings: TaskSettings, keys: LockKeys, holder: Holder,
               args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    raise DuplicateTaskError(task.name, keys.base, holder.task_id)


DuplicatePolicy = Callable[
    ["SingletonTask", "TaskSettings", LockKeys, Holder, Sequence[Any], Mapping[str, Any]], Any
]

ON_DUPLICATE: dict[str, DuplicatePolicy] = {
    "skip": _dup_skip,
    "retry": _dup_retry,
    "raise": _dup_raise,
}


def wait_for_original(task: SingletonTask, settings: TaskSettings, keys: LockKeys,
                      holder: Holder, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """A redelivered copy of a running task: come back later, touch no result."""
    logger.info(
        "Redelivered %s[%s] waits for its running original (%s on %s)",
        task.name, task.request.id, keys.base, holder.hostname,
    )
    countdown, waits = backoff(task, settings)
    republish(task, args, kwargs, countdown, waits)
    raise Ignore()


# -- Redis unavailable ----------------------------------------------------------

def _backend_retry(task: SingletonTask, settings: TaskSettings, keys: LockKeys,
                   exc: Exception, run: Callable[[], Any],
                   args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    logger.warning(
        "Lock backend unavailable for %s[%s] (%r): retrying later",
        task.name, task.request.id, exc,
    )
    try:
        raise _wait(task, settings, args, kwargs, f"lock backend unavailable: {exc!r}")
    except Retry:
        raise
    except Exception as publish_exc:
        # Neither Redis nor the broker took it: fail loudly, never drop silently.
        raise LockBackendError(keys.base, f"{exc!r}; retry not sent: {publish_exc!r}") from exc


def _backend_run(task: SingletonTask, settings: TaskSettings, keys: LockKeys,
                 exc: Exception, run: Callable[[], Any],
                 args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    logger.warning(
        "Lock backend unavailable for %s[%s] (%r): running WITHOUT the lock",
        task.name, task.request.id, exc,
    )
    return run()


def _backend_raise(task: SingletonTask, settings: TaskSettings, keys: LockKeys,
                   exc: Exception, run: Callable[[], Any],
                   args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    raise LockBackendError(keys.base, repr(exc)) from exc


BackendErrorPolicy = Callable[
    ["SingletonTask", "TaskSettings", LockKeys, Exception, Callable[[], Any],
     Sequence[Any], Mapping[str, Any]],
    Any,
]

ON_BACKEND_ERROR: dict[str, BackendErrorPolicy] = {
    "retry": _backend_retry,
    "run": _backend_run,
    "raise": _backend_raise,
}
