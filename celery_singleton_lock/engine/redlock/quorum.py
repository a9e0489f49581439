"""Talking to N masters at once: one thread per master, answers combined as they come.

Each master has a thread with a queue, so the commands of this process reach
every master in the order they were made (a release sent without waiting
arrives before the next acquire), and a master that hangs holds up only its
own queue. :meth:`Masters.each` waits until the answer is decided (a majority
said yes, said something else, or failed) or every master answered, never
longer than ``call_timeout``. What each lock operation makes of the answers is
in :mod:`.engine`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, TypeVar

from ...process import ForkSafeLock
from ..base import Engine

T = TypeVar("T")


class _Missing:
    """No answer (yet) from a master."""

    def __repr__(self) -> str:
        return "no answer"


MISSING = _Missing()


class Master:
    """One master: its name, its engine, and the thread that talks to it."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pid = 0
        self._lock = ForkSafeLock()

    def submit(self, job: Callable[[], None]) -> None:
        executor = self._executor
        if executor is None or self._pid != os.getpid():
            with self._lock:  # a forked child makes its own thread
                if self._executor is None or self._pid != os.getpid():
                    self._executor = ThreadPoolExecutor(
                        1, thread_name_prefix=f"singleton-redlock-{self.name}")
                    self._pid = os.getpid()
                executor = self._executor
        try:
            executor.submit(job)
        except RuntimeError:  # the interpreter is exiting: no new threads, run it here
            job()


def _describe(error: Any) -> str:
    if error is MISSING:
        return "no answer in time"
    return f"{type(error).__name__}: {error}"


def _settled_by(quorum: int, answer: type, yes: Callable[[Any], bool]
                ) -> Callable[[list[Any]], bool]:
    """Whether the answers so far decide a call: a majority said yes, said
    something else, or failed; the masters still to answer cannot change it."""
    def decided(results: list[Any]) -> bool:
        said_yes = sum(1 for r in results if yes(r))
        said_no = sum(1 for r in results if isinstance(r, answer) and not yes(r))
        failed = sum(1 for r in results if isinstance(r, Exception))
        return max(said_yes, said_no, failed) >= quorum
    return decided


class Masters:
    """The masters of a Redlock engine and the way every call reaches them."""

    def __init__(self, masters: list[Master], call_timeout: float) -> None:
        self.masters = masters
        #: a majority of them
        self.quorum = len(masters) // 2 + 1
        #: the longest a call waits for the masters
        self.call_timeout = call_timeout

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.masters]

    # -- talking to every master ---------------------------------------------------

    def each(self, call: Callable[[Engine], T], *,
             decided: Optional[Callable[[list[Any]], bool]] = None,
             timeout: Optional[float] = None, only: Optional[Sequence[int]] = None,
             skip_stale: bool = True) -> list[Any]:
        """``call(engine)`` on every master (or those at ``only``), concurrently.

        Returns one entry per master: its result, the exception it raised, or
        :data:`MISSING` when it had not answered when the outcome was
        ``decided`` or ``timeout`` ran out (its call still goes on, in order).
        ``skip_stale``: a call still queued long after its caller gave up (behind
        a master that hung) is not sent at all; releases are always sent.
        """
        indexes = range(len(self.masters)) if only is None else only
        results: list[Any] = [MISSING] * len(self.masters)
        done = threading.Condition()
        pending = set(indexes)
        started = time.monotonic()
        limit = self.call_timeout if timeout is None else timeout
        deadline = started + limit

        def job(i: int) -> Callable[[], None]:
            def run() -> None:
                if skip_stale and time.monotonic() > deadline + self.call_timeout:
                    # queued behind a master that hung: its caller gave up long ago
                    outcome: Any = TimeoutError("given up while queued")
                else:
                    try:
                        outcome = call(self.masters[i].engine)
                    except Exception as exc:  # any failure is that master's non-answer
                        outcome = exc
                with done:
                    results[i] = outcome
                    pending.discard(i)
                    done.notify_all()
            return run

        for i in indexes:
            self.masters[i].submit(job(i))
        with done:
            while pending:
                if decided is not None and decided(results):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                done.wait(remaining)
            return list(results)

    def failed(self, results: list[Any], ok: Callable[[Any], bool]) -> dict[str, str]:
        """The masters whose answer was not ``ok``: those that failed, and those
        not heard from when the failures alone do not explain the outcome."""
        errors = {m.name: _describe(r) for m, r in zip(self.masters, results)
                  if isinstance(r, Exception)}
        if len(errors) >= self.quorum:
            return errors
        return {m.name: _describe(r) for m, r in zip(self.masters, results) if not ok(r)}
