"""One hierarchy for every error the library raises; each names what it is about.

Each error keeps its constructor arguments as ``args`` so it survives the trip
through a result backend (Celery rebuilds an exception as ``cls(*args)``), and
builds its message from them.
"""

from __future__ import annotations

from typing import Optional

import redis


class SingletonError(Exception):
    """Base class of every error raised by celery-singleton-lock."""

    key: Optional[str] = None

    def _message(self) -> str:
        return " ".join(str(a) for a in self.args)

    def __str__(self) -> str:
        return self._message()

    def __repr__(self) -> str:
        # what Celery's log line and Flower's "exception" show: the message,
        # not the constructor's arguments
        return f"{type(self).__name__}({self._message()!r})"


class ConfigurationError(SingletonError):
    """A setting or task option has a value the library cannot work with.

    ``setting`` is the name the user typed (``singleton_ttl``, ...).
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(setting, message)
        self.setting = setting
        self.detail = message

    def _message(self) -> str:
        return f"{self.setting}: {self.detail}"


class KeyEncodingError(SingletonError, TypeError):
    """An argument cannot be turned into a stable lock key.

    The message names the task and the argument, never the value (it may be a
    card number or an e-mail address).
    """

    def __init__(self, task: str, argument: str, reason: str) -> None:
        super().__init__(task, argument, reason)
        self.task = task
        self.argument = argument
        self.reason = reason

    def _message(self) -> str:
        if self.argument == "*":  # the call does not fit the signature: no argument to leave out
            return f"task {self.task!r}: no singleton key for this call: {self.reason}"
        if self.argument == "singleton_key":  # the key function's own doing
            return f"task {self.task!r}: singleton_key: {self.reason}"
        return (
            f"task {self.task!r}: argument {self.argument!r} cannot be part of a singleton "
            f"key: {self.reason}. Choose the key's arguments with singleton_key=(...) "
            "or a function."
        )


class InvalidArgumentsError(SingletonError, ValueError):
    """A ``pydantic=True`` task's argument does not validate as its annotated model.

    Such a call could never run, so it is refused where its key is made (at
    send, and by ``singleton_keys`` and ``celery singleton key``). The message
    names the task, the argument, the model and each failing field with
    pydantic's reason, never the value sent.
    """

    def __init__(self, task: str, argument: str, model: str, problems: str) -> None:
        super().__init__(task, argument, model, problems)
        self.task = task
        self.argument = argument
        self.model = model
        self.problems = problems

    def _message(self) -> str:
        return (f"task {self.task!r}: argument {self.argument!r} is not a valid "
                f"{self.model}: {self.problems}")


class DuplicateTaskError(SingletonError):
    """The ``raise`` policy: another execution holds this task's key.

    ``state`` says what the holder is doing: ``"queued"`` (sent, not started),
    ``"running"`` or ``"done"`` (succeeded within ``singleton_done_ttl``).
    """

    def __init__(self, task: str, key: str, holder: Optional[str],
                 state: Optional[str] = None) -> None:
        super().__init__(task, key, holder, state)
        self.task = task
        self.key = key
        self.holder = holder
        self.state = state

    def _message(self) -> str:
        return (
            f"task {self.task!r} is already {self.state or 'held'} under key {self.key} "
            f"(holder task id {self.holder})"
        )


class WaitingForKey(SingletonError):
    """Why a duplicate under ``retry`` was sent again: Celery records it as the
    reason of the RETRY, so Flower shows whom the duplicate waits for."""

    def __init__(self, task: str, key: str, holder: Optional[str]) -> None:
        super().__init__(task, key, holder)
        self.task = task
        self.key = key
        self.holder = holder

    def _message(self) -> str:
        return f"waits for {self.key}: held by task id {self.holder}"


class LockLostError(SingletonError):
    """The running task no longer owns its lock (lease ran out or was taken over)."""

    def __init__(self, key: str, token: int, reason: str) -> None:
        super().__init__(key, token, reason)
        self.key = key
        self.token = token
        self.reason = reason

    def _message(self) -> str:
        return f"lock {self.key} (token {self.token}) was lost: {self.reason}"


class LockBackendError(SingletonError):
    """The lock's Redis could not be reached and the policy is ``raise``."""

    def __init__(self, key: Optional[str], cause: str) -> None:
        super().__init__(key, cause)
        self.key = key
        self.cause = cause

    def _message(self) -> str:
        return f"lock backend unavailable for key {self.key}: {self.cause}"


class StaleTokenError(SingletonError):
    """A fenced write was refused: the row carries a newer fencing token than the
    writer's, so a later holder of the lock has written it (see
    :mod:`celery_singleton_lock.fencing`).

    ``table`` and ``row`` say where (``row`` as the caller selected it, e.g.
    ``{"id": 42}``), ``token`` is the refused writer's token, ``stored`` the
    token the row holds, ``key`` the lock's key when the writer gave its lock.
    """

    def __init__(self, table: str, row: object, token: int, stored: Optional[int],
                 key: Optional[str] = None) -> None:
        super().__init__(table, row, token, stored, key)
        self.table = table
        self.row = row
        self.token = token
        self.stored = stored
        self.key = key

    def _message(self) -> str:
        lock = f" (lock {self.key})" if self.key else ""
        return (
            f"stale write to {self.table} {self.row!r} refused: token {self.token}{lock} "
            f"is older than the token {self.stored} the row holds; a later holder of the "
            "lock has written it"
        )


class TooFewReplicasError(SingletonError, redis.RedisError):
    """``WAIT`` after a grant heard from fewer replicas than
    ``singleton_wait_replicas`` and the policy is ``release``: the lock was
    given back. A Redis error too, so ``singleton_on_backend_error`` decides
    what the task does (by default: retry later)."""

    def __init__(self, key: Optional[str], acked: int, wanted: int) -> None:
        super().__init__(key, acked, wanted)
        self.key = key
        self.acked = acked
        self.wanted = wanted

    def __str__(self) -> str:
        return (f"{self.acked} of {self.wanted} replicas acknowledged the lock {self.key} "
                f"within singleton_wait_timeout; released it")


class UnconfirmedHolderError(TooFewReplicasError):
    """The key is held by a grant that ``WAIT`` has not confirmed yet (too few
    replicas have acknowledged it), and did not within the time an execution
    waits for that: its holder is not known to run, so the refused execution
    is not dropped as its duplicate; ``singleton_on_backend_error`` decides
    (by default: retry later)."""

    def __init__(self, key: Optional[str], holder: str, waited: float) -> None:
        super().__init__(key, 0, 0)
        self.holder = holder
        self.waited = waited

    def __str__(self) -> str:
        return (f"the lock {self.key} is held by a grant still waiting on WAIT for its "
                f"replicas (execution {self.holder}) after {self.waited:.1f} s: not known "
                "to run")


class LateRequestError(SingletonError, redis.RedisError):
    """A lock request that came too late for its caller: it reached the lock
    Redis after its deadline, the moment its caller was to give up waiting
    for the reply (``socket_timeout``), and the server did nothing with it;
    or its reply took so long that the grant might expire before its holder
    could confirm it, and it was given back. No grant outlives the call that
    asked for it. A Redis error: ``singleton_on_backend_error`` decides (by
    default: retry later)."""

    def __init__(self, script: str, server_ms: int, deadline_ms: int) -> None:
        super().__init__(script, server_ms, deadline_ms)
        self.script = script
        #: the server's clock when the request arrived (0: it was the reply that was slow)
        self.server_ms = server_ms
        self.deadline_ms = deadline_ms

    def __str__(self) -> str:
        if not self.server_ms:
            return (f"the reply to the {self.script} request took over half of its caller's "
                    f"wait (socket_timeout): the grant was given back")
        late = f" ({self.server_ms - self.deadline_ms} ms late)" if self.deadline_ms else ""
        return (f"the {self.script} request reached the lock Redis after its caller's "
                f"deadline{late}: refused, nothing done")


class QuorumError(SingletonError, redis.ConnectionError):
    """Too few masters of a ``redlock://`` URL answered for a majority to decide.

    A Redis connection error too, so ``singleton_on_backend_error`` decides
    what the task does (by default: retry later). ``failed`` names each master
    that did not answer and why."""

    def __init__(self, what: str, failed: dict[str, str], answered: int, needed: int) -> None:
        super().__init__(what, failed, answered, needed)
        self.what = what
        self.failed = failed
        self.answered = answered
        self.needed = needed

    def __str__(self) -> str:
        names = "; ".join(f"{name}: {why}" for name, why in self.failed.items())
        return (f"{self.what}: {self.answered} master(s) answered, a majority needs "
                f"{self.needed}; no answer from {names}")


class UnexpectedReplyError(SingletonError):
    """A script answered with something it never returns (a Redis or library mismatch)."""

    def __init__(self, script: str, reply: object) -> None:
        super().__init__(script, repr(reply))
        self.script = script
        self.reply = reply

    def _message(self) -> str:
        return f"script {self.script!r} gave a reply it never gives: {self.args[1]}"


def describe(error: Optional[BaseException]) -> str:
    """An error as a log line shows it: ``ConnectionError: Error 111 connecting
    to redis:6379. Connection refused.``, its type and its text. (redis-py 8
    gives its errors a repr of their category alone, ``network:ConnectionError``,
    which says neither what failed nor where.)"""
    if error is None:
        return "no error given"
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
