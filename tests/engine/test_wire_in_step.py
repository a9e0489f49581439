"""Every reply read by the call that sent for it: a connection of the wire goes
back to its idle list only with every reply of its last write read, or closed.

A write of the wire can carry several commands (``SET`` of a WAIT marker, the
script, ``WAIT``; several renewals; a native grant's five commands), and any
of them can answer with an error while the others answer normally: a full
Redis (``OOM``), a Cluster whose other primary is down (``CLUSTERDOWN``), a
slot moving (``TRYAGAIN``), a demoted primary (``READONLY``). A reply left
unread is the next call's first reply: that call acts on another call's
answer (a stale ``OK`` read as a grant's reply, a grant read as a release's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from typing import Any, Iterator, Optional

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.scripts import Script
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.engine.wire import Wire
from celery_singleton_lock.keys import LockKeys
from tests.support import RedisServer


def _script(name: str, source: str) -> Script:
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


#: a script that answers its argument, one that answers its argument as an
#: error, and one that does either (the second argument says which)
ECHO = _script("echo", "return ARGV[1]")
FAIL = _script("fail", "return redis.error_reply(ARGV[1])")
MAYBE = _script("maybe", "if ARGV[2] == 'fail' then return redis.error_reply(ARGV[1]) end "
                         "return ARGV[1]")
#: error replies a failover, a full Redis or a wrong call give (LOADING is a
#: connection error to redis-py: the connection is closed, not left in step)
CODES = ("CLUSTERDOWN The cluster is down", "TRYAGAIN Multiple keys request during rehashing",
         "READONLY You can't write against a read only replica.", "MASTERDOWN Link down",
         "OOM command not allowed", "ERR something else", "WRONGTYPE Operation against a key")


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.cleanup()


def _wire(server: RedisServer) -> Wire:
    client = redis.Redis(port=server.port, decode_responses=True, socket_timeout=5)
    return Wire(client, (ECHO, FAIL, MAYBE))


def _command(kind: Optional[str], payload: str) -> tuple[Any, ...]:
    """``before``/``after`` of a call: EVAL answering ``payload``, or an error."""
    if kind is None:
        return ()
    if kind == "ok":
        return ("EVAL", ECHO.source, 0, payload)
    return ("EVAL", FAIL.source, 0, kind)


def _in_step(wire: Wire) -> None:
    owing = [link.owed for link in wire._idle if link.owed]
    assert owing == [], f"idle connections still owed replies: {owing}"


def _same_error(error: BaseException, code: str) -> bool:
    """``error`` is the error reply ``code`` (redis-py drops a code it has a
    class for from the text)."""
    return isinstance(error, redis.ResponseError) and code.endswith(str(error))


step = st.one_of(
    st.tuples(st.just("with"), st.sampled_from([None, "ok", *CODES]),
              st.sampled_from(["ok", *CODES]), st.sampled_from([None, "ok", *CODES])),
    st.tuples(st.just("later"), st.sampled_from(["ok", *CODES])),
    st.tuples(st.just("many"), st.lists(st.sampled_from(["ok", *CODES]), min_size=1,
                                        max_size=4)),
    st.tuples(st.just("settle")),
)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=25))
def test_every_call_reads_its_own_replies_whatever_error_comes_where(server, steps) -> None:
    """Random interleavings of calls whose commands answer with errors at any
    place of a write (before the script, the script, after it, some of several
    scripts, a call whose reply is read later): each call gets exactly its own
    answer, and no idle connection owes a reply."""
    wire = _wire(server)
    history: list[str] = []
    later: list[tuple[str, str, list[Any]]] = []

    def check_later() -> None:
        for payload, kind, got in later:
            assert got, f"{payload}: never answered; history: {history}"
            reply, error = got[0]
            if kind == "ok":
                assert error is None and reply == payload, (payload, got, history)
            else:
                assert reply is None and _same_error(error, kind), (kind, got, history)
        later.clear()

    try:
        for s in steps:
            payload = uuid.uuid4().hex
            history.append(repr(s))
            if s[0] == "with":
                _, before, script, after = s
                run = ECHO if script == "ok" else FAIL
                arg = payload if script == "ok" else script
                try:
                    reply, _, late = wire.call_with(run, [], [arg],
                                                    before=_command(before, "b" + payload),
                                                    after=_command(after, "a" + payload))
                except redis.ResponseError as exc:
                    assert script != "ok", (s, exc, history)
                    assert _same_error(exc, script), (s, exc, history)
                else:
                    assert script == "ok" and reply == payload, (s, reply, history)
                    if after == "ok":
                        assert late == "a" + payload, (s, late, history)
                    elif after is not None:
                        assert _same_error(late, after), (s, late, history)
            elif s[0] == "later":
                kind = s[1]
                got: list[Any] = []
                later.append((payload, kind, got))
                wire.call_later(ECHO if kind == "ok" else FAIL, [],
                                [payload if kind == "ok" else kind],
                                lambda r, e, _rep, got=got: got.append((r, e)))
            elif s[0] == "many":
                kinds = s[1]
                calls = [([], [f"{payload}-{i}", "ok"] if k == "ok" else [k, "fail"])
                         for i, k in enumerate(kinds)]
                errors = [k for k in kinds if k != "ok"]
                try:
                    answers, _ = wire.call_many(MAYBE, calls)
                except redis.ResponseError as exc:
                    assert errors and _same_error(exc, errors[0]), (s, exc, history)
                else:
                    assert not errors, (s, answers, history)
                    assert answers == [a[0] for _, a in calls], (s, answers, history)
            else:
                wire.settle()
                check_later()
            _in_step(wire)
        wire.settle()
        check_later()
        _in_step(wire)
    finally:
        wire.close()


def test_a_full_redis_mid_grant_leaves_every_later_call_its_own_reply(own_redis) -> None:
    """WAIT on: a grant is one write of three commands (the WAIT marker's SET,
    the script, WAIT). With the server full (maxmemory reached, noeviction)
    the SET and the script answer OOM and WAIT answers normally: that grant
    fails, and every call after it gets its own reply (before: the next grant
    read the earlier script's OOM and WAIT's 0 as its own, off by one reply
    from then on)."""
    config = dataclasses.replace(
        SingletonConfig.defaults(own_redis.url(0)), wait_replicas=1, wait_timeout=50,
        wait_no_replica="proceed", native="off")
    engine = connect(config)
    assert isinstance(engine, LockEngine)
    admin = own_redis.client()
    keys = [LockKeys("singleton:", uuid.uuid4().hex) for _ in range(12)]

    def take(k: LockKeys, i: int) -> Any:
        return engine.acquire(k, Request(task_id=f"t{i}", exec_id=f"e{i}",
                                         lease=Lease.of_ms(30_000), hostname="w@h", retries=0,
                                         task_name="t.x"))

    assert take(keys[0], 0).status is Acquire.GRANTED
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            take(keys[1], 1)
    finally:
        admin.config_set("maxmemory", 0)
    tokens = []
    for i, k in enumerate(keys[2:], start=2):
        got = take(k, i)
        assert got.status is Acquire.GRANTED, got
        tokens.append(got.token)
        assert engine.release(k, f"e{i}", f"t{i}") is True
        assert admin.get(k.lock) is None
    assert engine.release(keys[0], "e0", "t0") is True
    assert admin.get(keys[1].lock) is None  # the failed grant holds nothing
    assert isinstance(engine.wire, Wire)
    _in_step(engine.wire)
    engine.close()
