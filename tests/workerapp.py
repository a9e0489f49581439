"""The Celery app the test workers run (`celery -A tests.workerapp:app worker`).

Configured from the environment so one module serves every worker the tests
start. Tasks record what they do in Redis db 3 (list ``events``), so a test can
see every start and end, the pid that ran it, its token and how many ran at once.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Any, Optional

import redis
from celery import Celery

from celery_singleton_lock import SingletonTask


def recorder(redis_url: str) -> redis.Redis:
    base = redis_url.rsplit("/", 1)[0]
    return redis.Redis.from_url(f"{base}/3", decode_responses=True)


def make_app(redis_url: str, queue: str = "celery", lock_url: Optional[str] = None,
             conf: Optional[dict[str, Any]] = None) -> Celery:
    base = redis_url.rsplit("/", 1)[0]
    app = Celery("slt", broker=f"{base}/0", backend=f"{base}/1", set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        singleton_redis_url=lock_url or f"{base}/2",
        singleton_ttl=2.0,
        singleton_retry_delay=0.2,
        singleton_retry_max_delay=1.0,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    app.conf.update(conf or {})
    rec = recorder(redis_url)
    task = functools.partial(app.task, shared=False)
    if app.conf.get("slt_record_received"):
        record_received(app, rec)
    one_server = not str(app.conf.singleton_redis_url).startswith("redlock")

    def body(task: Any, key: str, seconds: float, tag: str, fail: bool = False) -> Any:
        n = rec.incr(f"active:{key}")
        start = {"ev": "start", "tag": tag, "id": task.request.id, "pid": os.getpid(),
                 "token": task.singleton.token, "lockkey": task.singleton.key,
                 "concurrent": n, "retries": task.request.retries, "key": key,
                 "slot": task.singleton.slot, "t": time.time(),
                 # a wait's sender's offset from the lock Redis's clock (tests/conflict/
                 # test_retry_clock.py)
                 "clock": getattr(task.request, "singleton_clock", None)}
        rec.rpush("events", json.dumps(start))
        try:
            deadline, polls = time.monotonic() + seconds, 0
            while time.monotonic() < deadline:
                time.sleep(0.02)
                polls += 1  # a test may end the wait early: SET finish:<key>
                if polls % 5 == 0 and rec.exists(f"finish:{key}"):
                    break
            if fail:
                raise ValueError("task failed on purpose")
            return {"tag": tag, "token": task.singleton.token, "lost": task.singleton.lost,
                    "pid": os.getpid()}
        finally:
            rec.decr(f"active:{key}")
            rec.rpush("events", json.dumps({
                "ev": "end", "tag": tag, "id": task.request.id, "pid": os.getpid(),
                "lost": task.singleton.lost, "token": task.singleton.token, "key": key,
                "t": time.time()}))

    @task(base=SingletonTask, bind=True, name="t.hold", singleton_key=("key",))
    def hold(self: Any, key: str, seconds: float = 0.0, tag: str = "", fail: bool = False) -> Any:
        return body(self, key, seconds, tag, fail)

    @task(base=SingletonTask, bind=True, name="t.hold_retry", singleton_key=("key",),
              singleton_on_duplicate="retry")
    def hold_retry(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.hold_raise", singleton_key=("key",),
              singleton_on_duplicate="raise")
    def hold_raise(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.hold_late", singleton_key=("key",),
              acks_late=True, reject_on_worker_lost=True)
    def hold_late(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.hold_soft", singleton_key=("key",),
              soft_time_limit=0.5)
    def hold_soft(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.hold_hard", singleton_key=("key",),
              time_limit=0.5)
    def hold_hard(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.hold_hard_deaf", singleton_key=("key",),
              time_limit=0.5)
    def hold_hard_deaf(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        # a body that runs no Python code when the pool's SIGTERM comes (as one
        # stuck in a C call): the pool kills its process with SIGKILL right after
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return body(self, key, seconds, tag)
        finally:
            signal.signal(signal.SIGTERM, previous)

    @task(base=SingletonTask, bind=True, name="t.retrier", singleton_key=("key",),
              max_retries=5)
    def retrier(self: Any, key: str, attempts: int = 1, countdown: float = 0.5,
                seconds: float = 0.0, tag: str = "") -> Any:
        result = body(self, key, seconds, f"{tag}#{self.request.retries}")
        if self.request.retries < attempts:
            raise self.retry(countdown=countdown)
        return result

    @task(base=SingletonTask, bind=True, name="t.fenced", singleton_key=("key",))
    def fenced(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        token = self.singleton.token
        rec.rpush("events", json.dumps({"ev": "start", "tag": tag, "token": token,
                                        "pid": os.getpid(), "id": self.request.id}))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
        # What a careful writer does before touching the protected resource:
        lost = self.singleton.lost
        try:
            self.singleton.check()
            checked = "ok"
        except Exception as exc:
            checked = type(exc).__name__
        return {"tag": tag, "token": token, "lost": lost, "check": checked}

    @task(base=SingletonTask, bind=True, name="t.hold_short", singleton_key=("key",),
          singleton_ttl=1.0)
    def hold_short(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    if app.conf.get("slt_native_only"):
        # only tasks whose options need no script: a lock Redis that runs none
        return app

    # -- scopes and the done window -------------------------------------------
    for scope in ("queue", "queue_and_run"):
        for policy in ("skip", "retry", "raise"):
            suffix = "" if policy == "skip" else f"_{policy}"

            @task(base=SingletonTask, bind=True, name=f"t.{scope}{suffix}", singleton_key=("key",),
                  singleton_scope=scope, singleton_on_duplicate=policy)
            def scoped(self: Any, key: str, seconds: float = 0.0, tag: str = "",
                       fail: bool = False) -> Any:
                return body(self, key, seconds, tag, fail)

        @task(base=SingletonTask, bind=True, name=f"t.{scope}_retrier", singleton_key=("key",),
              singleton_scope=scope, max_retries=5)
        def scoped_retrier(self: Any, key: str, attempts: int = 1, countdown: float = 0.5,
                           seconds: float = 0.0, tag: str = "") -> Any:
            result = body(self, key, seconds, f"{tag}#{self.request.retries}")
            if self.request.retries < attempts:
                raise self.retry(countdown=countdown)
            return result

        @task(base=SingletonTask, bind=True, name=f"t.{scope}_done", singleton_key=("key",),
              singleton_scope=scope, singleton_done_ttl=3)
        def scoped_done(self: Any, key: str, seconds: float = 0.0, tag: str = "",
                        fail: bool = False) -> Any:
            return body(self, key, seconds, tag, fail)

    @task(base=SingletonTask, bind=True, name="t.run_done", singleton_key=("key",),
          singleton_done_ttl=3)
    def run_done(self: Any, key: str, seconds: float = 0.0, tag: str = "",
                 fail: bool = False) -> Any:
        return body(self, key, seconds, tag, fail)

    @task(base=SingletonTask, bind=True, name="t.run_done_long", singleton_key=("key",),
          singleton_done_ttl=120)
    def run_done_long(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    # -- at most N per key --------------------------------------------------------
    if one_server:  # slots are not on Redlock (refused at start)
        @task(base=SingletonTask, bind=True, name="t.limit3", singleton_key=("key",),
              singleton_limit=3)
        def limit3(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return {**body(self, key, seconds, tag), "slot": self.singleton.slot}

        @task(base=SingletonTask, bind=True, name="t.limit2_retry", singleton_key=("key",),
              singleton_limit=2, singleton_on_duplicate="retry")
        def limit2_retry(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return {**body(self, key, seconds, tag), "slot": self.singleton.slot}

        @task(base=SingletonTask, bind=True, name="t.limit2", singleton_key=("key",),
              singleton_limit=2)
        def limit2(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return {**body(self, key, seconds, tag), "slot": self.singleton.slot}

    # -- the throttle window -----------------------------------------------------
    @task(base=SingletonTask, bind=True, name="t.throttle", singleton_key=("key",),
          singleton_throttle=3)
    def throttle(self: Any, key: str, seconds: float = 0.0, tag: str = "",
                 fail: bool = False) -> Any:
        return body(self, key, seconds, tag, fail)

    @task(base=SingletonTask, bind=True, name="t.throttle_long", singleton_key=("key",),
          singleton_throttle=120)
    def throttle_long(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.throttle_retry", singleton_key=("key",),
          singleton_throttle=2, singleton_on_duplicate="retry")
    def throttle_retry(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.throttle_brief", singleton_key=("key",),
          singleton_throttle=0.8, singleton_on_duplicate="retry")
    def throttle_brief(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        """Its window always reopens in under a second: every wait is shorter."""
        return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.throttle_retrier", singleton_key=("key",),
          singleton_throttle=30, max_retries=3)
    def throttle_retrier(self: Any, key: str, tag: str = "") -> Any:
        result = body(self, key, 0.0, f"{tag}#{self.request.retries}")
        if self.request.retries < 1:
            raise self.retry(countdown=0.2)
        return result

    # -- replace, and debounce -----------------------------------------------------
    if one_server:  # 'replace' is not on Redlock (refused at start)
        for scope in ("queue", "queue_and_run"):
            @task(base=SingletonTask, bind=True, name=f"t.{scope}_replace", singleton_key=("key",),
                  singleton_scope=scope, singleton_on_duplicate="replace")
            def replacing(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
                return body(self, key, seconds, tag)

        @task(base=SingletonTask, bind=True, name="t.debounce", singleton_key=("key",),
              singleton_scope="queue", singleton_on_duplicate="replace", singleton_debounce=1.0)
        def debounce(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return body(self, key, seconds, tag)

        @task(base=SingletonTask, bind=True, name="t.debounce_short", singleton_key=("key",),
              singleton_scope="queue", singleton_on_duplicate="replace", singleton_debounce=0.5)
        def debounce_short(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return body(self, key, seconds, tag)

        @task(base=SingletonTask, bind=True, name="t.debounce_max", singleton_key=("key",),
              singleton_scope="queue", singleton_on_duplicate="replace", singleton_debounce=1.0,
              singleton_debounce_max=2.5)
        def debounce_max(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
            return body(self, key, seconds, tag)

    @task(base=SingletonTask, bind=True, name="t.collect", singleton_scope="queue_and_run")
    def collect(self: Any, results: list[Any]) -> Any:
        return results

    if os.environ.get("SLT_BAD_TASK_TTL"):
        @task(base=SingletonTask, name="t.bad_ttl",
              singleton_ttl=float(os.environ["SLT_BAD_TASK_TTL"]))
        def bad_ttl() -> None:
            return None

    if os.environ.get("SLT_TASK_OPTIONS"):  # a JSON object: a task with these options
        @task(base=SingletonTask, name="t.options", **json.loads(os.environ["SLT_TASK_OPTIONS"]))
        def options() -> None:
            return None

    @task(bind=True, name="t.plain")
    def plain(self: Any, key: str, seconds: float = 0.0, tag: str = "") -> Any:
        return {"tag": tag}

    return app


def record_received(app: Celery, rec: redis.Redis) -> None:
    """The worker's main process records every message it receives (event
    ``received``): when, the ETA it carries, and the broker's headers on it
    (a quorum queue's ``x-delivery-count``, the ``x-death`` entries)."""
    from celery.signals import task_received

    def received(sender: Any = None, request: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:  # another app's worker in this process
            return
        headers = getattr(request.message, "headers", None) or {}
        eta = request.eta
        rec.rpush("events", json.dumps({
            "ev": "received", "id": request.id, "name": request.name, "t": time.time(),
            "eta": eta.timestamp() if eta is not None else None,
            "delivery_count": headers.get("x-delivery-count"),
            "deaths": len(headers.get("x-death") or ()),
            "waits": headers.get("singleton_waits"), "hostname": request.hostname}))

    task_received.connect(received, weak=False)


def _from_env() -> Celery:
    url = os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0")
    return make_app(
        url,
        os.environ.get("SLT_QUEUE", "celery"),
        os.environ.get("SLT_LOCK_URL") or None,
        json.loads(os.environ.get("SLT_CONF") or "{}"),
    )


def __getattr__(name: str) -> Celery:
    # `celery -A tests.workerapp:app` asks for it; the tests' own process never does.
    if name == "app":
        app = _from_env()
        globals()["app"] = app
        return app
    raise AttributeError(name)
