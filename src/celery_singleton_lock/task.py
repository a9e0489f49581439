"""SingletonTask: take the key's lock before the body runs, hold it while it runs."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import redis
from celery import Task
from celery.exceptions import Ignore, Retry
from kombu.utils.uuid import uuid

from . import policies
from .config import (
    DUPLICATE_POLICIES,
    SCOPES,
    SingletonConfig,
    check_choice,
    check_optional_ttl,
    check_ttl,
    get_config,
)
from .exceptions import ConfigurationError, DuplicateTaskError, LockBackendError
from .heartbeat import heartbeat_for
from .keys import KeyBuilder, KeySpec, LockKeys
from .lock import (
    ACQUIRED,
    DONE,
    FINISHED,
    FREE,
    HELD,
    TAKEN,
    LockEngine,
    Outcome,
    ReleaseReply,
    SingletonLock,
    engine_for,
)
from .results import DeduplicatedResult

logger = logging.getLogger("celery_singleton_lock")

_LOCK_ATTR = "_singleton_lock"
_ENTERED_ATTR = "_singleton_entered"


@dataclass(frozen=True)
class TaskSettings:
    """A task's options merged over the app's settings; built once per task."""

    config: SingletonConfig
    builder: KeyBuilder
    ttl: float
    on_duplicate: str
    scope: str = "run"
    done_ttl: float = 0.0

    @property
    def retry_delay(self) -> float:
        return self.config.retry_delay

    @property
    def retry_max_delay(self) -> float:
        return self.config.retry_max_delay


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task of which at most one execution per key runs at a time.

    Options (task decorator arguments or class attributes):

    ``singleton_key``          argument names, a function of the task's arguments,
                               or None for all arguments
    ``singleton_on_duplicate`` ``"skip"``, ``"retry"`` or ``"raise"``
    ``singleton_ttl``          lease in seconds, renewed while the task runs
    ``singleton_scope``        ``"run"``, ``"queue"`` or ``"queue_and_run"``
    ``singleton_done_ttl``     seconds a success keeps its key done (0 or None: off)
    """

    singleton_key: KeySpec = None
    singleton_on_duplicate: Optional[str] = None
    singleton_ttl: Optional[float] = None
    singleton_scope: Optional[str] = None
    singleton_done_ttl: Optional[float] = None

    _singleton_settings_cache: Optional[TaskSettings] = None
    _singleton_settings_mutex = threading.Lock()

    @classmethod
    def bind(cls, app: Any) -> Any:
        from .bootsteps import SingletonStep

        app.steps["worker"].add(SingletonStep)
        return super().bind(app)

    # -- settings ---------------------------------------------------------------

    def singleton_settings(self) -> TaskSettings:
        """Validated settings of this task (raises ConfigurationError naming the option)."""
        settings = self._singleton_settings_cache
        if settings is None:
            with self._singleton_settings_mutex:
                settings = self._singleton_settings_cache
                if settings is None:
                    settings = self._build_settings()
                    self._singleton_settings_cache = settings
        return settings

    def _build_settings(self) -> TaskSettings:
        config = get_config(self.app)
        try:
            ttl = config.ttl if self.singleton_ttl is None else check_ttl(
                "singleton_ttl", self.singleton_ttl
            )
            on_duplicate = config.on_duplicate if self.singleton_on_duplicate is None else (
                check_choice("singleton_on_duplicate", self.singleton_on_duplicate,
                             DUPLICATE_POLICIES)
            )
            scope = config.scope if self.singleton_scope is None else check_choice(
                "singleton_scope", self.singleton_scope, SCOPES, "scope"
            )
            done_ttl = config.done_ttl if self.singleton_done_ttl is None else (
                check_optional_ttl("singleton_done_ttl", self.singleton_done_ttl)
            )
        except ConfigurationError as exc:
            raise ConfigurationError(exc.setting, f"task {self.name!r}: {exc}") from None
        builder = KeyBuilder(self.name, self.run, self.singleton_key, config.key_prefix)
        return TaskSettings(config=config, builder=builder, ttl=ttl, on_duplicate=on_duplicate,
                            scope=scope, done_ttl=done_ttl)

    def singleton_keys(self, *args: Any, **kwargs: Any) -> LockKeys:
        """The lock keys a call with these arguments uses."""
        return self.singleton_settings().builder.keys(args, kwargs)

    # -- what the running task sees -------------------------------------------

    @property
    def singleton(self) -> SingletonLock:
        """This execution's lock: ``.key``, ``.token``, ``.lost``, ``.check()``."""
        req = self.request
        lock: Optional[SingletonLock] = getattr(req, _LOCK_ATTR, None)
        if lock is None:
            keys = self.singleton_keys(*(req.args or ()), **(req.kwargs or {}))
            lock = SingletonLock(keys, task_id=req.id or "", task_name=self.name)
            setattr(req, _LOCK_ATTR, lock)
        return lock

    # -- sending ----------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: Optional[str] = None,
                    **options: Any) -> Any:
        """Celery's apply_async; under the queue scopes the key is taken here.

        When the key is already taken, no message is sent and the result of the
        task holding it comes back: a :class:`DeduplicatedResult`.
        """
        settings = self.singleton_settings()
        if (
            settings.scope == "run"
            or self.app.conf.task_always_eager
            or (task_id is not None and task_id == self.request.id)  # its own retry or wait
        ):
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        fresh_id = task_id is None
        task_id = task_id or uuid()
        keys = settings.builder.keys(args or (), kwargs or {})
        engine = engine_for(self.app)
        marker_ms = int((_send_delay(self, options) + settings.config.queue_ttl) * 1000)
        try:
            outcome = engine.enqueue(keys, task_id, settings.scope, marker_ms)
        except redis.RedisError as exc:
            if settings.config.on_backend_error == "raise":
                raise LockBackendError(keys.base, repr(exc)) from exc
            logger.warning("Lock backend unavailable when sending %s[%s] (%r): sent without "
                           "its key; the lock is still taken when it runs", self.name, task_id, exc)
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        # Nobody else has an id made just now: if it holds the key, the engine's
        # repeat after a broken connection found its own first attempt's work.
        taken = outcome.status == ACQUIRED or (
            fresh_id and outcome.holder is not None and outcome.holder.task_id == task_id
        )
        if not taken:
            assert outcome.holder is not None
            holder = outcome.holder.task_id
            in_canvas = "chain" in options or any(options.get(o) for o in _CANVAS_OPTIONS)
            if in_canvas:
                # Refusing would leave a chain or chord waiting for ever: the
                # worker gives this member the result a duplicate gets.
                pass
            elif outcome.status == DONE:
                logger.info("Not sent %s[%s]: %s was done by %s",
                            self.name, task_id, keys.base, holder)
                return DeduplicatedResult(holder, key=keys.base, reason="done",
                                          refused_id=task_id, task=self)
            elif settings.on_duplicate == "raise":
                raise DuplicateTaskError(self.name, keys.base, holder)
            elif settings.on_duplicate == "skip":
                logger.info("Not sent %s[%s]: %s is taken by %s",
                            self.name, task_id, keys.base, holder)
                return DeduplicatedResult(holder, key=keys.base, reason="duplicate",
                                          refused_id=task_id, task=self)
            # "retry": sent all the same; it waits for the key when it starts
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except BaseException:
            with contextlib.suppress(redis.RedisError):  # else it expires on its own
                engine.unqueue(keys, task_id)
            raise

    # -- execution --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request_stack.top
        if req is None or req.called_directly or getattr(req, _ENTERED_ATTR, False):
            # A plain function call (also from inside a running task): no lock.
            return super().__call__(*args, **kwargs)
        setattr(req, _ENTERED_ATTR, True)
        if req.is_eager:
            setattr(req, _LOCK_ATTR, SingletonLock(
                self.singleton_keys(*args, **kwargs), task_id=req.id or "", task_name=self.name
            ))
            return self.run(*args, **kwargs)
        return self._run_locked(req, args, kwargs)

    def _run_locked(self, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        settings = self.singleton_settings()
        keys = settings.builder.keys(args, kwargs)
        engine = engine_for(self.app)
        exec_id = LockEngine.new_exec_id()
        lease_ms = int(settings.ttl * 1000)
        started = time.monotonic()
        try:
            outcome = self._acquire(engine, keys, req, exec_id, lease_ms)
        except redis.RedisError as exc:
            policy = policies.ON_BACKEND_ERROR[settings.config.on_backend_error]

            def run_unlocked() -> Any:
                setattr(req, _LOCK_ATTR, SingletonLock(keys, task_id=req.id, task_name=self.name))
                return self.run(*args, **kwargs)

            return policy(self, settings, keys, exc, run_unlocked, args, kwargs)

        if outcome.status == FINISHED:
            logger.info(
                "Dropped redelivered %s[%s]: this task id already finished", self.name, req.id
            )
            raise Ignore()
        if outcome.status == DONE:
            assert outcome.holder is not None
            return policies.skip_done(self, keys, outcome.holder)
        if outcome.status != ACQUIRED:
            assert outcome.holder is not None
            if outcome.status == HELD:
                return policies.ON_DUPLICATE[settings.on_duplicate](
                    self, settings, keys, outcome.holder, args, kwargs
                )
            return policies.wait_for_original(self, settings, keys, outcome.holder, args, kwargs)

        lock = SingletonLock(
            keys, task_id=req.id, task_name=self.name, exec_id=exec_id,
            token=outcome.token, lease=settings.ttl, started=started, held=True,
        )
        setattr(req, _LOCK_ATTR, lock)
        logger.debug("Acquired singleton lock %s for %s[%s] token=%s",
                     keys.base, self.name, req.id, lock.token)
        heartbeat = heartbeat_for(engine)
        heartbeat.add(lock)
        succeeded = False
        try:
            result = self.run(*args, **kwargs)
            succeeded = True
            return result
        except Retry as exc:
            if not lock.handed_off:
                self._hand_off(engine, lock, _delay_of(self, exc.when))
            raise
        finally:
            heartbeat.discard(lock)
            if not lock.handed_off:
                self._release(engine, lock, settings.done_ttl if succeeded else 0.0)

    def _acquire(self, engine: LockEngine, keys: LockKeys, req: Any, exec_id: str,
                 lease_ms: int) -> Outcome:
        settings = self.singleton_settings()

        def attempt() -> Outcome:
            return engine.acquire(
                keys, task_id=req.id, exec_id=exec_id, lease_ms=lease_ms,
                hostname=req.hostname or "", retries=req.retries or 0, task_name=self.name,
                scope=settings.scope, comes_back=settings.on_duplicate == "retry",
            )

        outcome = attempt()
        holder = outcome.holder
        if holder is not None and engine.clear_dead_holder(keys, holder):
            outcome = attempt()
        return outcome

    def _release(self, engine: LockEngine, lock: SingletonLock, done_ttl: float = 0.0) -> None:
        lock.held = False
        name = self.name

        def answered(reply: Optional[ReleaseReply], error: Optional[Exception]) -> None:
            if error is not None or reply is None:
                logger.error(
                    "Could not release singleton lock %s of %s[%s] (%r): it frees within %ss",
                    lock.key, name, lock.task_id, error, lock.lease,
                )
            elif reply.status == FREE and reply.repeated:
                # The reply of the first attempt was lost with its connection;
                # finding the key free, the repeat most likely sees that attempt's work.
                logger.info("Released singleton lock %s of %s[%s] (the release was repeated "
                            "after a lost reply and found the key free)",
                            lock.key, name, lock.task_id)
            elif reply.status == FREE:
                lock.mark_lost("at release the lease had run out (the key was free)")
            elif reply.status == TAKEN:
                lock.mark_lost(
                    "at release another execution held the key" + (
                        " (the release was repeated after a lost reply: the first attempt "
                        "may have freed it before that execution took it)"
                        if reply.repeated else ""))

        # The command leaves now and Redis frees the key before anything this
        # process sends next; its reply is read on the next call.
        engine.release_later(lock.keys, lock.exec_id, lock.task_id, answered,
                             always_record=bool(self.acks_late), done_ttl=done_ttl)

    def _hand_off(self, engine: LockEngine, lock: SingletonLock, delay: float) -> None:
        lease_ms = int((max(delay, 0.0) + lock.lease) * 1000)
        try:
            lock.handed_off = engine.hand_off(
                lock.keys, lock.exec_id, (self.request.retries or 0) + 1, lease_ms
            )
        except redis.RedisError as exc:
            logger.error("Could not keep singleton lock %s for the retry: %r", lock.key, exc)

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None,
              **options: Any) -> Any:
        """Celery's retry; the key stays held for the retried execution."""
        lock: Optional[SingletonLock] = getattr(self.request, _LOCK_ATTR, None)
        handing_off = lock is not None and lock.held and not lock.handed_off
        if handing_off:
            assert lock is not None
            if eta is not None:
                delay = _delay_of(self, eta)
            elif countdown is not None:
                delay = float(countdown)
            else:
                delay = float(self.default_retry_delay or 0)
            # Before the message leaves: a fast retry must find the key kept for it.
            self._hand_off(engine_for(self.app), lock, delay)
        try:
            return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                                 countdown=countdown, max_retries=max_retries, **options)
        except Retry:
            raise
        except BaseException:
            if handing_off and lock is not None:
                lock.handed_off = False  # no retry was sent: release as usual
            raise


_CANVAS_OPTIONS = ("chord", "group_id", "link", "link_error")


def _send_delay(task: Task, options: dict[str, Any]) -> float:
    """Seconds until a message sent with these options may start."""
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            eta = None
    if isinstance(eta, dt.datetime):
        return _delay_of(task, eta)
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return max(float(countdown), 0.0)
    return 0.0


def _delay_of(task: Task, when: Any) -> float:
    if isinstance(when, dt.datetime):
        now = task.app.now() if when.tzinfo is not None else dt.datetime.now()
        return max((when - now).total_seconds(), 0.0)
    if isinstance(when, (int, float)):
        return float(when)
    return float(task.default_retry_delay or 0)



def send_task(app: Any, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
    """``app.send_task`` that honours the queue scopes.

    When ``name`` is a :class:`SingletonTask` registered in ``app`` (its module
    imported by the caller), the send goes through the task, so the key is taken
    at send time and a duplicate is refused as with ``apply_async``. Any other
    name is sent by ``app.send_task`` unchanged.
    """
    task = app.tasks.get(name)
    if isinstance(task, SingletonTask):
        return task.apply_async(args, kwargs, **options)
    return app.send_task(name, args, kwargs, **options)
