"""SingletonTask: take the key's lock before the body runs, hold it while it runs.

Orchestration only: the engine does the Redis work, :mod:`.conflict.policies` decides
what a conflict gets, and :mod:`.conflict.outcomes` carries the decision out with Celery.

Over 500 lines: one task's path from its send to its end, in the order a
call takes it (settings, send, the old library's key during a rollout, run,
retry); cut anywhere, a reader would follow one call across two files.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import redis
from celery import Task
from celery.exceptions import Ignore, Retry
from kombu.utils.uuid import uuid

from .config import REPLACE, TASK_OPTIONS, SingletonConfig, check_task_names, get_config
from .conflict import policies
from .conflict.canvas import delay_of, in_a_canvas, send_delay
from .conflict.outcomes import IGNORE, carry_out, carry_out_at_send
from .conflict.policies import Decision, Do
from .conflict.replacing import debounced, replace_args, supersede
from .conflict.results import is_deduplicated
from .engine.base import Engine
from .engine.registry import engine_for
from .engine.replies import Acquire, Acquired, Enqueue
from .engine.request import Lease, Request, to_ms
from .exceptions import DuplicateTaskError, LockBackendError, describe
from .keys import KeyBuilder, KeySpec, LockKeys
from .lock import REQUEST_ATTR, SingletonLock
from .models import ModelArguments
from .observe import monitor, traces
from .process import PROCESS, ForkSafeLock
from .rollout import SENT_HEADER, OtherLibrary, OtherLock
from .worker import coroutines
from .worker.coroutines import held_while_awaited
from .worker.heartbeat import heartbeat_for
from .worker.step import SingletonStep
from .worker.ticks import claim_tick_run

logger = logging.getLogger("celery_singleton_lock")

_ENTERED_ATTR = "_singleton_entered"


@dataclass(frozen=True)
class TaskSettings:
    """A task's settings (the app's, its own options over them) and its key builder."""

    config: SingletonConfig
    builder: KeyBuilder
    #: ``singleton_ttl``, in seconds and milliseconds
    lease: Lease
    #: ``singleton_also_lock``: the library a fleet moves over from
    other: Optional[OtherLibrary] = None
    #: ``singleton_throttle`` and ``singleton_done_ttl`` as the engine counts them
    throttle_ms: int = field(init=False)
    done_ms: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "throttle_ms", to_ms(self.config.throttle))
        object.__setattr__(self, "done_ms", to_ms(self.config.done_ttl))


class SingletonTask(Task):  # type: ignore[misc]
    """A Celery task of which at most one execution per key runs at a time.

    Options (task decorator arguments or class attributes):

    ``singleton_key``          argument names, a function of the task's arguments,
                               or None for all arguments
    ``singleton_on_duplicate`` ``"skip"``, ``"retry"``, ``"raise"`` or ``"replace"``
                               (queue scopes: a send takes the place of a call
                               still queued)
    ``singleton_ttl``          lease in seconds, renewed while the task runs
    ``singleton_scope``        ``"run"``, ``"queue"`` or ``"queue_and_run"``
    ``singleton_done_ttl``     seconds a success keeps its key done (0 or None: off)
    ``singleton_throttle``     seconds: at most one start per key in that window,
                               whatever its outcome (0 or None: off)
    ``singleton_rate``         ``"10/m"``: at most 10 starts per key in any minute,
                               across the fleet (:mod:`.rate`)
    ``singleton_debounce``     with ``"replace"``: seconds the queued call waits
                               after the latest send (``singleton_debounce_max``:
                               never longer than that after the burst's first)
    """

    singleton_key: KeySpec = None
    singleton_on_duplicate: Optional[str] = None
    singleton_ttl: Optional[float] = None
    singleton_scope: Optional[str] = None
    singleton_done_ttl: Optional[float] = None
    singleton_throttle: Optional[float] = None
    singleton_rate: Optional[str] = None
    singleton_debounce: Optional[float] = None
    singleton_debounce_max: Optional[float] = None

    #: the worker's request class: it tells the pool process whether task
    #: events are on now (a skip then shows as SKIPPED in Flower)
    Request = "celery_singleton_lock.worker.step:SingletonRequest"

    #: a duplicate refused under the ``raise`` policy is expected: Celery logs
    #: it as one INFO line, not as an ERROR with a traceback
    throws: tuple[type[BaseException], ...] = (DuplicateTaskError,)

    _singleton_settings_cache: Optional[TaskSettings] = None
    _singleton_settings_mutex = ForkSafeLock()

    @classmethod
    def bind(cls, app: Any) -> Any:
        # the worker step checks the settings at start and wires the signals
        app.steps["worker"].add(SingletonStep)
        # a task's own throws=(...) adds to ours
        throws = cls.throws if isinstance(cls.throws, tuple) else (cls.throws,)
        if not any(issubclass(DuplicateTaskError, t) for t in throws):
            cls.throws = (*throws, DuplicateTaskError)
        return super().bind(app)

    # -- settings ---------------------------------------------------------------

    def singleton_settings(self, *, reload: bool = False) -> TaskSettings:
        """Checked settings of this task (raises ConfigurationError naming the option).

        ``reload=True`` reads the app's settings and the task's options again.
        """
        settings = None if reload else self._singleton_settings_cache
        if settings is None:
            with self._singleton_settings_mutex:
                settings = None if reload else self._singleton_settings_cache
                if settings is None:
                    check_task_names(self.name, self._own_names())
                    config = get_config(self.app, reload=reload).for_task(self.name, {
                        s.name: getattr(self, s.name, None) for s in TASK_OPTIONS})
                    spec = self._key_spec()
                    builder = KeyBuilder(self.name, self.run, spec, config.key_prefix,
                                         ModelArguments.of(self.name, self.run, self.app))
                    other = None if config.also_lock is None else OtherLibrary.for_task(
                        config.also_lock, self.app, self.name, builder.signature,
                        builder.names, callable(spec))
                    settings = TaskSettings(config, builder, Lease(config.ttl), other)
                    self._singleton_settings_cache = settings
        return settings

    @classmethod
    def _key_spec(cls) -> KeySpec:
        """``singleton_key`` as the user wrote it: a key function set as a
        decorator option is a class attribute, which ``self.singleton_key``
        would bind to the task as a method."""
        spec: Any = inspect.getattr_static(cls, "singleton_key", None)
        if isinstance(spec, staticmethod):
            return spec.__func__
        if isinstance(spec, classmethod):
            return cls.singleton_key
        checked: KeySpec = spec
        return checked

    @classmethod
    def _own_names(cls) -> dict[str, Any]:
        """What the task's classes below this one set, by name: its decorator's
        options too."""
        # read the classes' own dicts: getattr on SingletonTask would run Celery's
        # class property ``app``, which binds the base class to the current app
        known = {n for klass in SingletonTask.__mro__ for n in vars(klass)}
        names: dict[str, Any] = {}
        for klass in reversed(cls.__mro__[:cls.__mro__.index(SingletonTask)]):
            names.update((n, v) for n, v in vars(klass).items() if n not in known)
        return names

    def singleton_keys(self, *args: Any, **kwargs: Any) -> LockKeys:
        """The lock keys a call with these arguments uses."""
        return self.singleton_settings().builder.keys(args, kwargs)

    # -- what the running task sees -------------------------------------------

    @property
    def singleton(self) -> SingletonLock:
        """This execution's lock: ``.key``, ``.token``, ``.lost``, ``.check()``."""
        lock = coroutines.CURRENT.get()  # an async def body's, in its own context
        if lock is not None and lock.task_name == self.name:
            return lock
        req = self.request
        lock = getattr(req, REQUEST_ATTR, None)
        if lock is None:
            keys = self.singleton_keys(*(req.args or ()), **(req.kwargs or {}))
            lock = SingletonLock(keys, task_id=req.id or "", task_name=self.name)
            setattr(req, REQUEST_ATTR, lock)
        return lock

    # -- sending ----------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: Optional[str] = None,
                    **options: Any) -> Any:
        """Celery's apply_async; under the queue scopes the key is taken here.

        When the key is already taken, no message is sent and the result of the
        task holding it comes back: a :class:`DeduplicatedResult`.
        """
        settings = self.singleton_settings()
        own_again = task_id is not None and task_id == self.request.id  # its own retry or wait
        if settings.builder.models is not None and not own_again:
            # pydantic=True: a call whose models do not validate could never run
            settings.builder.arguments(args or (), kwargs or {})
        if self.app.conf.task_always_eager or own_again:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if settings.other is None:
            return self._send(settings, args, kwargs, task_id, options)
        return self._send_also_locked(settings, settings.other, args, kwargs, task_id, options)

    def _send_also_locked(self, settings: TaskSettings, other: OtherLibrary, args: Any,
                          kwargs: Any, task_id: Optional[str], options: dict[str, Any]) -> Any:
        """A send while ``singleton_also_lock`` is on: the old library's key is taken
        first, as that library takes it when it sends (docs/migration.md)."""
        other_key = other.key(args or (), kwargs or {})
        if other_key is None:  # the old library could not have sent it: nothing to take
            return self._send(settings, args, kwargs, task_id, options)
        fresh_id = task_id is None
        task_id = task_id or uuid()
        try:
            holder = other.take_at_send(other_key, task_id)
        except redis.RedisError as exc:
            decision = policies.on_backend_error(settings.config.on_backend_error, phase="send",
                                                 key=other_key, error=exc)
            if decision.do is Do.FAIL:
                assert decision.error is not None
                raise decision.error from exc
            logger.warning("%s's lock Redis unavailable when sending %s[%s] (%s): sent "
                           "without its key", other.library, self.name, task_id, describe(exc))
            return self._send(settings, args, kwargs, task_id, options, fresh_id=fresh_id)
        if holder is not None:
            refused = carry_out_at_send(
                self, policies.other_key_taken(settings.config.on_duplicate, holder,
                                               task_name=self.name, key=other_key),
                other_key, task_id, engine_for(self.app))
            assert refused is not None
            return refused
        headers = {**(options.get("headers") or {}), SENT_HEADER: other.library}
        released = other.lock(other_key, task_id, adopt=False)
        try:
            # the old library's key was free: any call queued for this key is
            # over (it held that key until its run ended, on an old worker too)
            sent = self._send(settings, args, kwargs, task_id, {**options, "headers": headers},
                              fresh_id=fresh_id, queued_is_over=True)
        except BaseException:
            released.release()
            raise
        if is_deduplicated(sent):  # refused by our own send-time key
            released.release()
        return sent

    def _send(self, settings: TaskSettings, args: Any, kwargs: Any, task_id: Optional[str],
              options: dict[str, Any], *, fresh_id: Optional[bool] = None,
              queued_is_over: bool = False) -> Any:
        """Send, taking the send-time key under the queue scopes.
        ``queued_is_over``: a call another send queued for the key is known to
        be over (its key left behind by a worker of the old library, which
        runs it and never frees ours): freed, and this send takes the key."""
        config = settings.config
        if config.scope == "run":
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if fresh_id is None:
            fresh_id = task_id is None
        task_id = task_id or uuid()
        keys = settings.builder.keys(args or (), kwargs or {})
        engine = engine_for(self.app)
        in_canvas = in_a_canvas(task_id, options)
        replace = None if in_canvas else replace_args(config)
        marker_ms = int((send_delay(self, options) + config.queue_ttl + config.debounce) * 1000)
        try:
            answer = engine.enqueue(keys, task_id, config.scope, marker_ms, self.name, replace,
                                    done=config.done_ttl > 0)
            if queued_is_over and answer.holder is not None and answer.status is Enqueue.HELD \
                    and not answer.running and answer.holder.task_id != task_id:
                logger.info("Freed the send-time key of %s for %s[%s]: its call is over "
                            "(run by a worker of %s)", keys.base, self.name,
                            answer.holder.task_id, settings.other.library
                            if settings.other is not None else "the old library")
                engine.unqueue(keys, answer.holder.task_id)
                answer = engine.enqueue(keys, task_id, config.scope, marker_ms, self.name,
                                        replace, done=config.done_ttl > 0)
        except redis.RedisError as exc:
            monitor.count(engine, "backend_errors", self.name, "send")  # metrics
            decision = policies.on_backend_error(config.on_backend_error, phase="send",
                                                 key=keys.base, error=exc)
            if decision.do is Do.FAIL:
                assert decision.error is not None
                raise decision.error from exc
            logger.warning("Lock backend unavailable when sending %s[%s] (%s): sent without "
                           "its key; the lock is still taken when it runs", self.name, task_id,
                           describe(exc))
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        if fresh_id and answer.holder is not None and answer.holder.task_id == task_id:
            # Nobody else has an id made just now: the engine's repeat after a
            # broken connection found its own first attempt's work.
            decision = Decision(Do.SEND, keyed=True)
        else:
            decision = policies.at_send(answer, on_duplicate=config.on_duplicate,
                                        task_name=self.name, key=keys.base, in_canvas=in_canvas)
        refused = carry_out_at_send(self, decision, keys.base, task_id, engine)
        if refused is not None:
            return refused
        try:
            sent = super().apply_async(args, kwargs, task_id=task_id,
                                       **debounced(self.app, options, answer.countdown_ms,
                                                  config))
        except BaseException:
            if decision.keyed:
                with contextlib.suppress(redis.RedisError):  # else it expires on its own
                    engine.unqueue(keys, task_id)
            raise
        if answer.superseded:
            supersede(self, keys.base, task_id, answer.superseded)
        return sent

    # -- execution --------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request_stack.top
        if req is None and inspect.iscoroutinefunction(self.run):
            # celery-aio-pool calls the task in a thread of its loop's executor,
            # with the request in the task's own default one (docs/pools.md)
            req = self.request
        if req is None or req.called_directly or getattr(req, _ENTERED_ATTR, None) == req.id:
            # A plain function call (also from inside a running task): no lock,
            # but the task's options are checked, as on its first send
            self.singleton_settings()
            return super().__call__(*args, **kwargs)
        # Entered until this call, or the coroutine it returns, ends: a nested
        # call meanwhile is a plain one. Cleared then, since a default request
        # outlives its call, and the next call may have the same id (a
        # duplicate sent back to wait under `retry`, to the same process).
        setattr(req, _ENTERED_ATTR, req.id)

        def left() -> None:
            setattr(req, _ENTERED_ATTR, None)

        try:
            if req.is_eager:
                setattr(req, REQUEST_ATTR, SingletonLock(
                    self.singleton_keys(*args, **kwargs), task_id=req.id or "",
                    task_name=self.name))
                result = self.run(*args, **kwargs)
            else:
                result = self._run_locked(req, args, kwargs)
        except BaseException:
            left()
            raise
        if inspect.iscoroutine(result):
            return coroutines.then(result, left)
        left()
        if result is IGNORE:
            raise Ignore()
        return result

    def _run_locked(self, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        settings = self.singleton_settings()
        config = settings.config
        keys = settings.builder.keys(args, kwargs)
        engine = engine_for(self.app)
        # Sent by a singleton beat: one run per (entry, tick) even if two beats
        # sent it (a claim lost in a failover). Looked at before the lock, so the
        # extra copy neither takes the key nor waits for it; claimed once the
        # lock is granted, so buffer_all reads "ended" right (docs/beat.md).
        tick = bool(getattr(req, "singleton_beat_tick", None))
        if tick and not claim_tick_run(engine, config.key_prefix, req, look_only=True):
            raise Ignore()
        other_key = settings.other.key(args, kwargs) if settings.other is not None else None
        if settings.other is None or other_key is None:
            return self._run_keyed(req, args, kwargs, settings, keys, engine, tick, None)
        # singleton_also_lock: the old library's key first, then ours (rollout.py)
        other = settings.other.lock(other_key, req.id, adopt=(
            settings.other.library == "celery_once" and not getattr(req, SENT_HEADER, None)))
        try:
            holder = other.take(settings.lease.ms)
        except redis.RedisError as exc:
            monitor.count(engine, "backend_errors", self.name, "run")  # metrics
            decision = policies.on_backend_error(config.on_backend_error, phase="run",
                                                 key=other_key, error=exc)
            return carry_out(self, decision, config, keys, args, kwargs, backend_error=exc)
        if holder is not None:
            decision = policies.held_elsewhere(config.on_duplicate, holder,
                                               task_name=self.name, key=other_key)
            return carry_out(self, decision, config, keys, args, kwargs)
        try:
            return self._run_keyed(req, args, kwargs, settings, keys, engine, tick, other)
        finally:
            if not other.kept:
                other.release()

    def _run_keyed(self, req: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   settings: TaskSettings, keys: LockKeys, engine: Engine, tick: bool,
                   other: Optional[OtherLock]) -> Any:
        """Take the key's lock, then run the body under it (``other``: the old
        library's lock this execution holds beside it)."""
        config = settings.config
        exec_id = PROCESS.new_exec_id()
        started = time.monotonic()
        try:
            answer = self._acquire(engine, settings, keys, req, exec_id,
                                   holds_old_key=other is not None)
        except redis.RedisError as exc:
            monitor.count(engine, "backend_errors", self.name, "run")  # metrics
            decision = policies.on_backend_error(config.on_backend_error, phase="run",
                                                 key=keys.base, error=exc)
            return carry_out(self, decision, config, keys, args, kwargs, backend_error=exc)
        traces.waited(keys, time.monotonic() - started)
        monitor.observe_acquire(engine, self.name, time.monotonic() - started)  # metrics

        if answer.status is not Acquire.GRANTED:
            decision = policies.at_run(answer, on_duplicate=config.on_duplicate,
                                       task_name=self.name, key=keys.base)
            if tick and decision.do not in (Do.WAIT, Do.WAIT_QUIETLY):
                claim_tick_run(engine, config.key_prefix, req)  # decided: not run
            return carry_out(self, decision, config, keys, args, kwargs)

        lock = SingletonLock(
            keys.slot(answer.slot), task_id=req.id, task_name=self.name, exec_id=exec_id,
            token=answer.token, lease=settings.lease, started=started, held=True,
            hostname=req.hostname or "", retries=req.retries or 0,
            margin=engine.lease_margin(settings.lease.seconds), slot=answer.slot,
            companion=other, confirmation=answer.confirmation,
        )
        if lock.expired:
            # The grant arrived after its lease could have run out (a stall on
            # the way): another execution may hold the key by now. Not a grant.
            self._release(engine, lock)
            stale = LockBackendError(keys.base, "the grant arrived after its lease ran out")
            decision = policies.on_backend_error(config.on_backend_error, phase="run",
                                                 key=keys.base, error=stale)
            return carry_out(self, decision, config, keys, args, kwargs, backend_error=stale)
        if tick and not claim_tick_run(engine, config.key_prefix, req):
            self._release(engine, lock)  # another copy of the tick took it meanwhile
            raise Ignore()
        setattr(req, REQUEST_ATTR, lock)
        traces.ran(keys, lock.token, lock.slot)
        logger.debug("Acquired singleton lock %s for %s[%s] token=%s",
                     keys.base, self.name, req.id, lock.token)
        heartbeat = heartbeat_for(engine)
        heartbeat.add(lock)
        # counted in memory; a thread of this process publishes it and the held lock
        monitor.count(engine, "acquired", self.name)
        def retried(exc: Retry) -> None:
            if not lock.handed_off:
                self._hand_off(engine, lock, delay_of(self, exc.when))

        def end(succeeded: bool, interrupted: bool) -> None:
            heartbeat.discard(lock)
            if not lock.handed_off:
                self._release(engine, lock, settings.done_ms if succeeded else 0,
                              finished=not interrupted)
            monitor.observe_hold(engine, self.name, time.monotonic() - started)

        succeeded = interrupted = awaited = False
        try:
            result = self.run(*args, **kwargs)
            if inspect.iscoroutine(result):
                # an async def body: held until the pool's loop has awaited it
                awaited = True
                return held_while_awaited(result, lock, retried, end)
            succeeded = True
            return result
        except Retry as exc:
            retried(exc)
            raise
        except BaseException as exc:
            # SystemExit (a cold shutdown, a terminate), KeyboardInterrupt: the
            # body neither returned nor raised; Celery records no outcome and an
            # acks_late message goes back to the queue. Not finished: it must run.
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            if not awaited:
                end(succeeded, interrupted)

    def _acquire(self, engine: Engine, settings: TaskSettings, keys: LockKeys, req: Any,
                 exec_id: str, holds_old_key: bool = False) -> Acquired:
        config = settings.config
        request = Request(req.id, exec_id, settings.lease, req.hostname or "", req.retries or 0,
                          self.name, config.scope, settings.throttle_ms, config.limit,
                          config.on_duplicate == REPLACE, settings.done_ms > 0,
                          config.rate_window)

        def attempt() -> Acquired:
            return engine.acquire(keys, request)

        answer = attempt()
        holder = answer.holder
        if (holds_old_key and self._stale_queued(answer) and holder is not None
                and engine.unqueue(keys, holder.task_id)):
            answer = attempt()
            holder = answer.holder
        if holder is not None and answer.status not in (
                Acquire.DONE, Acquire.THROTTLED, Acquire.REPLACED, Acquire.RATE_LIMITED) and (
                engine.clear_dead_holder(keys.slot(answer.slot), holder) or (
                    answer.status is Acquire.HELD and config.limit > 1
                    and engine.clear_dead_slots(keys, config.limit))):
            answer = attempt()
        return answer

    @staticmethod
    def _stale_queued(answer: Acquired) -> bool:
        """Refused by another call's send-time key, while this execution holds
        the old library's key (``singleton_also_lock``, taken when this
        message was sent or now): that call is over (it held that key until
        its run ended, and a worker of the old library never frees ours)."""
        return (answer.status is Acquire.HELD and answer.holder_state == "queued"
                and not answer.queued_by_it)

    def _release(self, engine: Engine, lock: SingletonLock, done_ms: int = 0,
                 finished: bool = True) -> None:
        """Free ``lock``; ``finished``: the body returned or raised (Celery records
        it), so a redelivered copy of this task id is dropped, not run again."""
        lock.held = False
        # The command leaves now and Redis frees the key before anything this
        # process sends next; its reply is read on the next call.
        engine.release_later(lock.keys, lock.exec_id, lock.task_id, lock.released,
                             always_record=bool(self.acks_late), done_ms=done_ms,
                             task_name=lock.task_name, finished=finished)

    def _hand_off(self, engine: Engine, lock: SingletonLock, delay: float) -> None:
        lease_ms = lock.lease.ms_after(delay)
        try:
            lock.handed_off = engine.hand_off(
                lock.keys, lock.exec_id, (self.request.retries or 0) + 1, lease_ms
            )
            if lock.handed_off and lock.companion is not None:
                # the old library's key waits for the retry too
                lock.companion.keep(lease_ms)
                lock.companion.kept = True
        except redis.RedisError as exc:
            logger.error("Could not keep singleton lock %s for the retry: %s", lock.key,
                         describe(exc))

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None,
              **options: Any) -> Any:
        """Celery's retry; the key stays held for the retried execution."""
        lock: Optional[SingletonLock] = getattr(self.request, REQUEST_ATTR, None)
        handing_off = lock is not None and lock.held and not lock.handed_off
        if handing_off:
            assert lock is not None
            if eta is not None:
                delay = delay_of(self, eta)
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
