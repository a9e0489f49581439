"""A SingletonTask whose body is a coroutine function (``async def``).

Under an asyncio pool (celery-aio-pool; docs/pools.md) the task's call returns
the body's coroutine, and the pool awaits it on its event loop, where other
executions of the process run between its ``await``s. The lock is taken
before that coroutine exists (in the task's call, as for any body); this
module keeps it held until the coroutine ends: returned, raised, retried
(handed to the retry) or cancelled. The worker's renewer, a thread of the
process, renews it meanwhile with every other lock the process holds, however
busy the loop is.

Which execution a coroutine belongs to is a context variable, set in the
coroutine's own context, so ``self.singleton`` in the body is its own lock
even where many executions of one task share the loop's thread.
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable, Optional

from celery.exceptions import Retry

from ..lock import SingletonLock

#: the lock of the execution whose coroutine runs in this context
CURRENT: contextvars.ContextVar[Optional[SingletonLock]] = contextvars.ContextVar(
    "celery_singleton_lock_current", default=None)


async def held_while_awaited(body: Awaitable[Any], lock: SingletonLock,
                             retried: Callable[[Retry], None],
                             end: Callable[[bool, bool], None]) -> Any:
    """Await ``body`` with ``lock`` held; then ``end(succeeded, interrupted)``
    frees it, as the task's call does for a plain body. ``retried(exc)`` hands
    the lock to a retry the body asked for without ``self.retry``.

    Interrupted, as a terminated plain body: cancelled (``CancelledError``,
    the asyncio pool's terminate or shutdown, an enclosing timeout) or any
    other exception that is not an ``Exception``."""
    CURRENT.set(lock)
    succeeded = interrupted = False
    try:
        result = await body
        succeeded = True
        return result
    except Retry as exc:
        retried(exc)
        raise
    except BaseException as exc:
        interrupted = not isinstance(exc, Exception)
        raise
    finally:
        end(succeeded, interrupted)


async def then(body: Awaitable[Any], after: Callable[[], None]) -> Any:
    """Await ``body``; ``after()`` once it has ended, however it ended."""
    try:
        return await body
    finally:
        after()
