"""What a conflict gets, at send and at run, and what Redis being down gets.

Every decision of the library lives here, one entry per phase:

* :func:`at_send`: a send under the ``queue`` scopes found its key taken;
* :func:`at_run`: an execution that starts found its key taken (or not);
* :func:`on_backend_error`: the lock Redis could not be reached, at either.

Each returns a :class:`Decision` and does nothing else: no Redis, no Celery.
:class:`~.task.SingletonTask` carries the decision out. So every rule can be
read, and tested, here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from ..config import OnBackendError, OnDuplicate, SingletonConfig
from ..engine.replies import Acquire, Acquired, Enqueue, Enqueued
from ..exceptions import DuplicateTaskError, LockBackendError, describe

#: the reason a call over its key's ``singleton_rate`` gives (skip results, logs, metrics)
RATE_LIMITED = "rate limited"


class Do(Enum):
    # at run
    RUN = "run"  #: run the body under the lock just granted
    RUN_UNLOCKED = "run unlocked"  #: run the body without a lock (backend policy "run")
    SKIP = "skip"  #: return the skip result at once; the body never runs
    WAIT = "wait"  #: send this very request again later; the caller sees RETRY meanwhile
    WAIT_QUIETLY = "wait quietly"  #: send it again later and touch no result (a copy)
    DROP = "drop"  #: ack and touch nothing: a late copy of a task that finished
    # at send
    SEND = "send"  #: send the message (the key taken, or not needed)
    REFUSE = "refuse"  #: send nothing; the caller gets the holder's result
    # either
    FAIL = "fail"  #: raise ``error``


@dataclass(frozen=True)
class Decision:
    do: Do
    #: the task id the decision is about (the one holding the key)
    holder: Optional[str] = None
    #: "duplicate", "done", "throttled" or "replaced" for SKIP and REFUSE; why,
    #: for the others
    reason: str = ""
    #: what the holder is doing: "queued", "running" or "done" ("" when no holder)
    state: str = ""
    error: Optional[Exception] = None
    #: SEND: the send-time key is this send's (False: sent without one)
    keyed: bool = False
    #: THROTTLED: seconds until the window reopens (WAIT: the countdown)
    reopens_in: Optional[float] = None


def at_send(answer: Enqueued, *, on_duplicate: OnDuplicate, task_name: str, key: str,
            in_canvas: bool) -> Decision:
    """A send under ``queue`` / ``queue_and_run`` asked for its key."""
    if answer.status is Enqueue.TAKEN:
        return Decision(Do.SEND, keyed=True)
    if answer.status is Enqueue.REPLACED:
        # "replace": the queued one had not started; this send takes its place
        return Decision(Do.SEND, keyed=True, reason="replaces",
                        holder=answer.holder.task_id if answer.holder else None)
    assert answer.holder is not None
    holder, state = answer.holder.task_id, answer.holder_state
    if in_canvas:
        # Refusing would leave a chain or chord waiting for ever: the worker
        # gives this member the result a duplicate gets when it starts.
        return Decision(Do.SEND, holder=holder, reason="canvas member")
    if answer.status is Enqueue.DONE:
        return Decision(Do.REFUSE, holder=holder, reason="done", state=state)
    do = AT_SEND[on_duplicate]
    if do is Do.SEND:
        # "retry": sent all the same; it waits for the key when it starts
        return Decision(Do.SEND, holder=holder, reason="waits when it starts")
    return _duplicate(do, holder, reason="duplicate", state=state, task_name=task_name, key=key)


#: what a duplicate gets, by ``singleton_on_duplicate``, at a send (under the
#: queue scopes) and when it starts. "replace" swaps only a call still queued
#: (:data:`.Enqueue.REPLACED`, :data:`.Acquire.REPLACED`): against a holder
#: that runs, is done or throttled, it is "skip".
AT_SEND: dict[OnDuplicate, Do] = {"skip": Do.REFUSE, "replace": Do.REFUSE,
                                  "retry": Do.SEND, "raise": Do.FAIL}
AT_RUN: dict[OnDuplicate, Do] = {"skip": Do.SKIP, "replace": Do.SKIP,
                                 "retry": Do.WAIT, "raise": Do.FAIL}


def _duplicate(do: Do, holder: Optional[str], *, reason: str, state: str, task_name: str,
               key: str, reopens_in: Optional[float] = None) -> Decision:
    """A duplicate's decision; a failing one carries the error that names the holder."""
    error = DuplicateTaskError(task_name, key, holder, state) if do is Do.FAIL else None
    return Decision(do, holder=holder, reason=reason, state=state, error=error,
                    reopens_in=reopens_in)


#: why an execution waits for a holder whose lock was not renewed on time
DOUBTFUL = "its holder's lock is not renewed on time"


def at_run(answer: Acquired, *, on_duplicate: OnDuplicate, task_name: str, key: str
           ) -> Decision:
    """An execution that starts asked for its lock."""
    status = answer.status
    if status is Acquire.GRANTED:
        return Decision(Do.RUN)
    holder = answer.holder.task_id if answer.holder is not None else None
    state = answer.holder_state
    if status is Acquire.REPLACED:
        # a later send took this queued call's place: that one runs instead
        return Decision(Do.SKIP, holder=holder, reason="replaced", state="queued")
    if status is Acquire.FINISHED:
        return Decision(Do.DROP, holder=holder, reason="this task id already finished")
    if status is Acquire.DONE:
        # within singleton_done_ttl of a success every duplicate is skipped
        return Decision(Do.SKIP, holder=holder, reason="done", state=state)
    if status in (Acquire.THROTTLED, Acquire.RATE_LIMITED):
        # singleton_throttle: another task started within the window;
        # singleton_rate: the key's window holds its N starts already. Skip, or
        # come back when the window reopens (never sooner), or raise
        reason = "throttled" if status is Acquire.THROTTLED else RATE_LIMITED
        return _duplicate(AT_RUN[on_duplicate], holder, reason=reason, state="started",
                          task_name=task_name, key=key, reopens_in=answer.reopens_ms / 1000.0)
    if status is Acquire.SAME_TASK:
        # a redelivered copy of a running task: it comes back later and is
        # dropped if the original finished, run if the original died
        return Decision(Do.WAIT_QUIETLY, holder=holder, reason="its running original")
    if answer.queued_by_it:
        # a send that was accepted must run: it waits for the one running
        return Decision(Do.WAIT, holder=holder, reason="accepted when sent; waits its turn")
    if answer.doubtful:
        # the holder's lock was not renewed on time: it may not be running (a
        # grant never confirmed, a holder cut off, a release on its way), so
        # not a duplicate of it yet; decided once the lock is renewed or gone
        return Decision(Do.WAIT, holder=holder, reason=DOUBTFUL, state=state,
                        reopens_in=answer.ttl_ms / 1000.0)
    return _duplicate(AT_RUN[on_duplicate], holder, reason="duplicate", state=state,
                      task_name=task_name, key=key)


def other_key_taken(on_duplicate: OnDuplicate, holder: str, *, task_name: str, key: str
                    ) -> Decision:
    """A send found the old library's key of its call taken
    (``singleton_also_lock``): refused, as that library refused it, or raised
    under ``raise``, whatever the scope."""
    do = Do.FAIL if on_duplicate == "raise" else Do.REFUSE
    return _duplicate(do, holder, reason="duplicate", state="queued", task_name=task_name,
                      key=key)


def held_elsewhere(on_duplicate: OnDuplicate, holder: str, *, task_name: str, key: str
                   ) -> Decision:
    """An execution that starts found the old library's key of its call held by
    another call (``singleton_also_lock``): a duplicate of a running one."""
    return _duplicate(AT_RUN[on_duplicate], holder, reason="duplicate", state="running",
                      task_name=task_name, key=key)


#: what a call gets when the lock Redis does not answer, by
#: ``singleton_on_backend_error``, at a send and when it starts
BACKEND_AT_SEND: dict[OnBackendError, Do] = {"retry": Do.SEND, "run": Do.SEND,
                                             "raise": Do.FAIL}
BACKEND_AT_RUN: dict[OnBackendError, Do] = {"retry": Do.WAIT, "run": Do.RUN_UNLOCKED,
                                            "raise": Do.FAIL}


def on_backend_error(policy: OnBackendError, *, phase: str, key: str, error: Exception
                     ) -> Decision:
    """The lock Redis could not be reached; ``phase`` is "send" or "run".

    At run: ``retry`` waits and never runs unlocked, ``run`` runs unlocked,
    ``raise`` fails the task. At send: ``raise`` raises to the caller; the
    others send without the send-time key (the run lock still applies).
    """
    do = (BACKEND_AT_SEND if phase == "send" else BACKEND_AT_RUN)[policy]
    if do is Do.FAIL:
        return Decision(Do.FAIL, reason="backend", error=LockBackendError(key, describe(error)))
    if do is Do.WAIT:
        return Decision(Do.WAIT, reason=f"lock backend unavailable: {describe(error)}")
    return Decision(do, reason="lock backend unavailable")


#: a throttled call sent again comes this long after its window reopens
THROTTLE_SLACK = 0.05


def backoff(config: SingletonConfig, waits: int, *, backend_error: bool = False) -> float:
    """The countdown of a task that has waited ``waits`` times already.

    Waiting for the lock Redis (``backend_error``) it never grows past twice
    ``singleton_retry_delay``, spread over its lower half: once Redis answers
    again, every waiting task runs within that (about a second by default),
    not all at the same moment. Each try costs a publish and no Redis call,
    since the lock calls fail at once during the outage.
    """
    if backend_error:
        ceiling: float = config.retry_delay * (2.0 if waits else 1.0)
        return ceiling * random.uniform(0.5, 1.0)
    delay: float = min(config.retry_delay * (2 ** min(waits, 30)), config.retry_max_delay)
    return delay * random.uniform(0.8, 1.2)
