"""A pool child forked while a thread of the main process was inside one of our
critical sections starts free; a long Redis outage leaves no connection behind;
through an outage (engine/outage.py) calls fail at once, what is owed goes
once the server answers, and a probe that hears nothing gives up.

Engine-level and process-level proofs; the real-worker forms are in test_chaos.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleton_lock import SingletonConfig, SingletonTask
from celery_singleton_lock.engine.outage import (
    Owed,
    RedisUnanswered,
    failing_over,
    owed_on,
    unreachable,
)
from celery_singleton_lock.engine.registry import connect, engine_for
from celery_singleton_lock.engine.replies import Acquire, Release, Released
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.process import ForkSafeLock
from tests.support import RedisServer, free_port, wait_for


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


class Answers:
    """``answered`` of a release sent without waiting: what it was told."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, Any]] = []
        self.told = threading.Event()

    def __call__(self, released: Any, error: Any) -> None:
        self.got.append((released, error))
        self.told.set()


def ask(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id,
                                        lease=Lease.of_ms(30_000), hostname="h", retries=0,
                                        task_name="t.x"))


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def held_then_stopped(own_redis: RedisServer) -> tuple[Any, LockKeys]:
    """An engine holding a lock (its confirmation read) on ``own_redis``,
    then the server stopped (kill -9)."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    held = LockKeys("singleton:", uuid.uuid4().hex)
    try:
        assert ask(engine, held, "a", "ea").status is Acquire.GRANTED
        engine.settle()
    except BaseException:
        engine.close()
        raise
    own_redis.stop()
    return engine, held


def test_calls_to_a_stopped_redis_fail_at_once_and_what_is_owed_goes_once_it_answers(
        own_redis: RedisServer):
    """engine/outage.py: the first call to a stopped server finds it refusing
    (nothing was read); every later call fails
    at once, naming the server, without a connection made; an acquire that
    failed is owed as its undo (sent twice) and a release sent without
    waiting is owed; once the server answers, the owed calls go, the release
    is told its answer as a repeat, and calls go through. A second outage of
    the same wire is waited out the same way."""
    engine, held = held_then_stopped(own_redis)
    try:
        with pytest.raises(redis.ConnectionError) as first:
            ask(engine, LockKeys("singleton:", uuid.uuid4().hex), "b", "eb")
        assert not isinstance(first.value, RedisUnanswered)
        outage = engine.wire.outage
        assert (outage.down, outage.owed) == (True, 1)
        made = engine.wire.connections
        for _ in range(3):
            with pytest.raises(RedisUnanswered) as unanswered:
                ask(engine, LockKeys("singleton:", uuid.uuid4().hex), "c", "ec")
            told = re.match(f"the lock Redis at {re.escape(engine.wire.name)} has not answered "
                            r"for (\d+\.\d) s", str(unanswered.value))
            assert told and float(told.group(1)) < 60  # since it began
        assert engine.wire.connections == made and outage.owed == 1
        answers = Answers()
        engine.release_later(held, "ea", "a", answers)  # never raises into the task
        assert outage.owed == 2 and answers.got == []
        own_redis.start()  # same port, empty: every owed call finds its key free
        assert answers.told.wait(15), "the owed release was never sent"
        wait_for(lambda: not outage.down, 5, what="calls to go through again")
        assert answers.got == [(Released(Release.FREE, repeated=True), None)]
        assert (outage.owed, outage.since) == (0, None)
        # on the fresh server: the undo twice, the release once, nothing else
        assert evalsha_calls(own_redis.client(0)) == 3
        assert ask(engine, held, "d", "ed").status is Acquire.GRANTED
        engine.settle()
        # a second outage of the same wire is waited out the same way
        own_redis.stop()
        with pytest.raises(redis.ConnectionError):
            ask(engine, LockKeys("singleton:", uuid.uuid4().hex), "e", "ee")
        assert outage.down
        own_redis.start()
        wait_for(lambda: not outage.down, 15, what="calls to go through after the second")
        assert ask(engine, held, "f", "ef").status is Acquire.GRANTED
    finally:
        engine.close()


def test_an_acquire_a_frozen_redis_did_not_answer_is_undone_once_it_runs(
        own_redis: RedisServer):
    """A frozen server (SIGSTOP) reads nothing, and runs what is in its
    buffers once it runs again: the acquire whose reply did not come in time
    begins an outage, and is undone twice (the second after the first
    one's reply), so nothing of it is left; a release owed meanwhile goes
    too. The server's own counts: the abandoned acquire, two undos, the
    release."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0),
                                              redis_options={"socket_timeout": 0.5}))
    held, lost = (LockKeys("singleton:", uuid.uuid4().hex) for _ in range(2))
    client = own_redis.client(0)
    try:
        assert ask(engine, held, "a", "ea").status is Acquire.GRANTED
        engine.settle()
        before = evalsha_calls(client)
        own_redis.pause()
        try:
            with pytest.raises(redis.TimeoutError):
                ask(engine, lost, "b", "eb")
            outage = engine.wire.outage
            assert (outage.down, outage.owed) == (True, 1)
            with pytest.raises(RedisUnanswered):
                ask(engine, lost, "b", "eb2")
            answers = Answers()
            engine.release_later(held, "ea", "a", answers)
            assert outage.owed == 2
        finally:
            own_redis.resume()
        assert answers.told.wait(15), "the owed release was never sent"
        wait_for(lambda: not outage.down, 5, what="calls to go through again")
        assert answers.got == [(Released(Release.RELEASED, repeated=True), None)]
        assert not client.exists(held.lock) and not client.exists(lost.lock)
        assert evalsha_calls(client) - before == 4
    finally:
        engine.close()


def test_an_outage_with_calls_owed_is_given_up_five_times_later_and_they_are_told(
        own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch):
    """A server that does not come back: the probe gives up after
    ``PROBE_GIVE_UP`` (shortened here), five times as long with calls owed;
    each owed call's ``answered`` is told it was not sent (a ConnectionError
    naming the server), and the next call tries for real."""
    from celery_singleton_lock.engine import outage as outage_module

    monkeypatch.setattr(outage_module, "PROBE_GIVE_UP", 0.3)
    engine, held = held_then_stopped(own_redis)
    try:
        answers = Answers()
        began = time.monotonic()
        engine.release_later(held, "ea", "a", answers)
        engine.settle()  # it met the connection the server closed: sent again, refused
        outage = engine.wire.outage
        assert outage.down and outage.owed == 1
        assert answers.told.wait(20), "the owed release was never given up"
        assert time.monotonic() - began >= 5 * 0.3
        ((released, error),) = answers.got
        assert released is None and isinstance(error, redis.ConnectionError)
        told = re.match(f"the lock Redis at {re.escape(engine.wire.name)} did not answer "
                        r"for (\d+) s", str(error))
        assert told and int(told.group(1)) < 60  # since it began
        wait_for(lambda: not outage.down, 5, what="the outage given up")
        assert outage.owed == 0
        with pytest.raises(redis.ConnectionError) as again:
            ask(engine, LockKeys("singleton:", uuid.uuid4().hex), "b", "eb")
        assert not isinstance(again.value, RedisUnanswered), "not tried for real"
    finally:
        engine.close()


def test_an_owed_call_the_server_refuses_for_good_is_told_and_ends_the_outage(
        own_redis: RedisServer):
    """An owed call that the server, answering again, refuses with an error no
    failover gives (a full Redis, a denied command, a script's error: here
    WRONGTYPE) is told that error and not sent again: the outage ends, and
    calls go through. (It was kept, and the outage with it, for as long as
    the process lived: every lock call failed at once against a live server.)"""
    import hashlib

    from celery_singleton_lock.engine.scripts import Script
    from celery_singleton_lock.engine.wire import Wire

    def script(name: str, src: str) -> Script:
        return Script(name, src, hashlib.sha1(src.encode()).hexdigest())

    refused = script("refused", "return redis.error_reply('WRONGTYPE Operation against a "
                                "key holding the wrong kind of value')")
    echo = script("echo", "return ARGV[1]")
    wire = Wire(redis.Redis(port=own_redis.port, decode_responses=True, socket_timeout=2),
                (refused, echo))
    try:
        assert wire.call(echo, [], ["before"]) == ("before", False)
        told: list[tuple[Any, Any]] = []
        answered = threading.Event()

        def tell(reply: Any, error: Any, repeated: bool) -> None:
            told.append((reply, error))
            answered.set()

        wire.outage.begin(redis.TimeoutError("no reply"), Owed(refused, [uuid.uuid4().hex], [],
                                                               tell))
        assert answered.wait(30), "the refused call was never told"
        ((reply, error),) = told
        assert reply is None and "WRONGTYPE" in str(error), told
        wait_for(lambda: not wire.outage.down, 10, what="the outage to end")
        assert wire.outage.owed == 0
        assert wire.call(echo, [], ["after"]) == ("after", False)
    finally:
        wire.close()


@pytest.mark.parametrize("error,unanswered,over", [
    (redis.ConnectionError("Connection refused"), True, False),
    (redis.TimeoutError("Timeout reading from socket"), True, False),
    (redis.AuthenticationError("invalid password"), False, False),
    (redis.exceptions.AuthorizationError("NOPERM"), False, False),
    (redis.exceptions.MaxConnectionsError("Too many connections"), False, False),
    (redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"), False, True),
    (redis.exceptions.TryAgainError("TRYAGAIN Multiple keys request during rehashing"),
     False, True),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
     False, True),
    # a ConnectionError to redis-py, and a failover's (a restart's) answer
    (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), True, True),
    (redis.ResponseError("MASTERDOWN Link with MASTER is down"), False, True),
    (redis.ResponseError("LOADING Redis is loading the dataset in memory"), False, True),
    (redis.ResponseError("READONLY You can't write against a read only replica."),
     False, True),
    (redis.ResponseError("ERR Error running script"), False, False),
    (redis.ResponseError("NOSCRIPT No matching script"), False, False),
    (redis.ResponseError("WRONGTYPE Operation against a key"), False, False),
    (ValueError("CLUSTERDOWN"), False, False),
], ids=lambda v: (f"{type(v).__name__}-{str(v).split(' ', 1)[0]}" if isinstance(v, Exception)
                  else "yes" if v else "no"))
def test_what_begins_an_outage_and_what_is_sent_again(error: Exception, unanswered: bool,
                                                      over: bool) -> None:
    """engine/outage.py: no answer (refused, timed out) and a failover's
    answer (redis-py's classes, or an older one's plain ResponseError whose
    text starts with the code) keep an owner-checked call for later; an error
    that shows the server answered (a wrong password, a refused user, a full
    client table) or refused the call itself does not."""
    assert unreachable(error) is unanswered
    assert failing_over(error) is over
    assert owed_on(error) is (unanswered or over)


def test_a_release_a_demoted_primary_refuses_is_sent_again_once_it_takes_writes(
        own_redis: RedisServer):
    """A failover's answer: the primary, demoted to a replica (``REPLICAOF``
    a primary that is nowhere), answers READONLY; the release did not run.
    It is owed, and sent again every little while the server answers the
    probe but refuses it (calls fail at once meanwhile), until the server is
    a primary again: then it frees the key, and calls go through."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    client = own_redis.client(0)
    try:
        assert ask(engine, keys, "a", "ea").status is Acquire.GRANTED
        engine.settle()
        client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        before = evalsha_calls(client)
        with pytest.raises(redis.exceptions.ReadOnlyError):
            engine.release(keys, "ea", "a")
        outage = engine.wire.outage
        assert (outage.down, outage.owed) == (True, 1)
        with pytest.raises(RedisUnanswered):
            ask(engine, LockKeys("singleton:", uuid.uuid4().hex), "b", "eb")
        wait_for(lambda: evalsha_calls(client) >= before + 3, 10,
                 what="the owed release sent again, and refused again")
        assert client.exists(keys.lock) and outage.down and outage.owed == 1
        client.execute_command("REPLICAOF", "NO", "ONE")
        wait_for(lambda: not outage.down, 10, what="the owed release taken")
        assert not client.exists(keys.lock) and outage.owed == 0
        assert ask(engine, keys, "c", "ec").status is Acquire.GRANTED
    finally:
        engine.close()
