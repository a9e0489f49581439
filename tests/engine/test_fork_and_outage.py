"""A pool child forked while a thread of the main process was inside one of our
critical sections starts free; a long Redis outage leaves no connection behind.

Engine-level and process-level proofs; the real-worker forms are in test_chaos.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import SingletonConfig, SingletonTask
from celery_singleton_lock.engine.registry import connect, engine_for
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.process import ForkSafeLock
from tests.support import RedisServer, wait_for


def take(engine: LockEngine, keys: LockKeys, task_id: str) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=uuid.uuid4().hex,
                                        lease=Lease.of_ms(5000), hostname="h", retries=0,
                                        task_name="t.x"))


def fork_and_run(work: Any, timeout: int = 5) -> int:
    """Run ``work`` in a forked child (killed after ``timeout`` s); its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: one thread, whatever the parent's threads held
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
        signal.alarm(timeout)
        try:
            work()
        except BaseException:
            os._exit(2)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_every_mutex_of_the_library_is_free_in_a_forked_child():
    """A thread of the parent holds every library mutex while the process forks
    (the reaper making the main process's engine as the pool replaces a child):
    the child takes each of them at once instead of blocking for ever."""
    app = Celery("fork", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=SingletonTask, name="fork.t", shared=False)
    def t() -> None:
        return None

    locks = list(ForkSafeLock._all)
    assert len(locks) >= 4  # engines, config cache, settings, heartbeat registry
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        for lock in locks:
            lock.__enter__()
        held.set()
        release.wait(30)
        for lock in locks:
            lock.__exit__(None, None, None)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert held.wait(5)
    try:
        def child() -> None:
            assert not any(lock.locked() for lock in ForkSafeLock._all)
            engine_for(app)  # takes the engine registry's mutex
            t.singleton_settings(reload=True)  # the settings' and the config's
        assert fork_and_run(child) == 0
    finally:
        release.set()
        thread.join(5)


#: events set when this process is about to fork (this module's hook runs before
#: the library's: a hook registered later runs earlier)
_forking: list[threading.Event] = []


def _note_fork() -> None:
    for event in _forking:
        event.set()


os.register_at_fork(before=_note_fork)


def _wchan(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/wchan") as fh:
        return fh.read()


def test_a_child_forked_while_a_thread_writes_a_log_line_can_log() -> None:
    """A thread of the parent is inside a log write when the process forks (the
    pipe it writes to is full, so it holds its stream's lock): the fork waits
    for that line to be written, and the child's own first line is written. A
    pool child forked so hung for ever in its "succeeded" line while the main
    process logged the lock of the child it replaced released. Here the pipe
    is drained only once the fork has begun."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_fd, b"." * 65536)
    os.set_blocking(write_fd, True)
    handler = logging.StreamHandler(os.fdopen(write_fd, "w"))
    log = logging.getLogger(f"fork-log-{uuid.uuid4().hex}")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    forking, done = threading.Event(), threading.Event()

    def drain() -> None:
        forking.wait(60)
        while not done.is_set():
            if select.select([read_fd], [], [], 0.1)[0]:
                os.read(read_fd, 1 << 16)

    writer = threading.Thread(target=lambda: log.info("x" * 200_000), daemon=True)
    drainer = threading.Thread(target=drain, daemon=True)
    writer.start()
    drainer.start()
    wait_for(lambda: "pipe_write" in _wchan(writer), 10,
             what="the writer blocked inside its write, its stream's lock held")
    _forking.append(forking)
    try:
        assert fork_and_run(lambda: log.info("the child's own line"), timeout=10) == 0
    finally:
        _forking.remove(forking)
        forking.set()
        writer.join(10)
        done.set()
        drainer.join(5)
        log.removeHandler(handler)
        handler.close()
        os.close(read_fd)


def test_a_long_outage_leaves_no_connection_behind(own_redis: RedisServer):
    """Hundreds of calls fail while Redis is down; the first call after it is
    back succeeds, and the engine never made more than a couple of connections."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    assert take(engine, keys, "a").status is Acquire.GRANTED
    own_redis.stop()
    for i in range(300):  # the pool's old limit was 100
        with pytest.raises(redis.ConnectionError):
            take(engine, keys, f"down-{i}")
    own_redis.start()
    # calls fail at once until the wire's probe has seen the server answer
    # (its retries back off to 0.25 s): then the first call goes through
    wait_for(lambda: not engine.wire.outage.down, 10, what="the probe to see Redis back")
    assert take(engine, keys, "back").status is Acquire.GRANTED
    assert engine.wire.connections <= 2


def test_a_wrong_password_stays_named_and_bounded(tmp_path):
    """Failed logins do not use connections up: the 300th attempt still says
    AuthenticationError, not 'too many connections'."""
    server = RedisServer(extra_args=["--requirepass", "right"]).start()
    try:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        engine = connect(SingletonConfig.defaults(url))
        keys = LockKeys("singleton:", uuid.uuid4().hex)
        for i in range(300):
            with pytest.raises(redis.AuthenticationError):
                take(engine, keys, f"t{i}")
        assert engine.wire.connections <= 2
    finally:
        server.cleanup()


def test_children_forked_while_a_thread_makes_engines_make_their_own_at_once():
    """Forks race a thread that keeps making engines (what the main process's
    reaper does after a child is killed): every child makes its own engine."""
    from celery_singleton_lock.config import get_config
    from celery_singleton_lock.engine.registry import forget_engine

    app = Celery("race", broker="redis://127.0.0.1:1/0", set_as_current=False)
    other = Celery("race2", broker="redis://127.0.0.1:1/0", set_as_current=False)
    # As in a worker, whose step reads the settings and makes an engine in the
    # main thread at start: later threads never read app.conf (every access
    # takes kombu's class-wide lock) nor import a module for the first time
    # (a thread inside either at fork would wedge the child).
    get_config(other)
    engine_for(other)
    forget_engine(other)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            engine_for(other)
            forget_engine(other)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        codes = [fork_and_run(lambda: engine_for(app)) for _ in range(40)]
    finally:
        stop.set()
        thread.join(5)
    assert codes == [0] * 40
