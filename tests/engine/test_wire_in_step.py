"""Every reply read by the call that sent for it: a connection of the wire goes
back to its idle list only with every reply of its last write read, or closed.

A write of the wire can carry several commands (``SET`` of a WAIT marker, the
script, ``WAIT``; several renewals; a native grant's five commands), and any
of them can answer with an error while the others answer normally: a full
Redis (``OOM``), a Cluster whose other primary is down (``CLUSTERDOWN``), a
slot moving (``TRYAGAIN``), a demoted primary (``READONLY``). A reply left
unread is the next call's first reply: that call acts on another call's
answer (a stale ``OK`` read as a grant's reply, a grant read as a release's).

After those, each way of calling (a call, one with a command before and
after, several at once, one whose reply is read later) when something goes
wrong between the write and its reply: a server that lost its scripts, a
reply lost with its connection, a connection the server closed, a server
that refuses, freezes or was demoted, a call interrupted (between its
reads, or as its connection connects), an outage begun by another thread,
a Sentinel primary frozen and replaced. Whether each call is sent again,
kept for when the server answers, or told, and whether it is told it was
repeated. A script that counts its runs in its key shows what the server
ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
import uuid
from typing import Any, Iterator, Optional

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.commands import COMMANDS, GRANT
from celery_singleton_lock.engine.outage import RedisUnanswered
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.scripts import Script
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.engine.wire import Wire
from celery_singleton_lock.keys import LockKeys
from tests.deployments import SentinelGroup
from tests.support import RedisServer, ReplyDroppingProxy, free_port, wait_for


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


#: a script that counts its runs in its key: how many times the server ran a call
COUNT = _script("count", "return redis.call('INCR', KEYS[1])")


class Told:
    """``answered`` of a call sent without waiting: what it was told."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, Any, bool]] = []
        self.told = threading.Event()

    def __call__(self, reply: Any, error: Any, repeated: bool) -> None:
        self.got.append((reply, error, repeated))
        self.told.set()


def _counting_wire(port: int, timeout: float = 5) -> Wire:
    client = redis.Redis(port=port, decode_responses=True, socket_timeout=timeout)
    return Wire(client, (COUNT, ECHO))


def test_a_server_that_lost_its_scripts_runs_each_call_once_whatever_the_way(
        own_redis: RedisServer) -> None:
    """SCRIPT FLUSH (a restart without persistence, a failover to a replica
    that never loaded them) before each way of calling: a call, one with a
    command before and after, several at once, two whose replies are read later.
    Each answers NOSCRIPT, gets its script loaded and is sent once more: every
    call gets its own reply, none is told it was repeated, and the server ran
    each exactly once (the count of its key)."""
    admin = own_redis.client()
    key = f"count:{uuid.uuid4().hex}"
    wire = _counting_wire(own_redis.port)
    try:
        assert wire.call(COUNT, [key], []) == (1, False)
        admin.script_flush()
        assert wire.call(COUNT, [key], []) == (2, False)
        admin.script_flush()
        assert wire.call_with(COUNT, [key], [], before=("EVAL", ECHO.source, 0, "b"),
                              after=("EVAL", ECHO.source, 0, "a")) == (3, False, "a")
        admin.script_flush()
        assert wire.call_many(COUNT, [([key], []), ([key], [])],
                              after=("EVAL", ECHO.source, 0, "w")) == ([4, 5], "w")
        admin.script_flush()
        told, next_told = Told(), Told()
        wire.call_later(COUNT, [key], [], told)
        wire.call_later(COUNT, [key], [], next_told)
        assert wire.unsettled == 2
        wire.settle()
        assert told.got == [(6, None, False)] and next_told.got == [(7, None, False)]
        assert admin.get(key) == "7" and wire.unsettled == 0
        assert not wire.down and wire.discarded == 0
        _in_step(wire)
    finally:
        wire.close()


def test_a_reply_lost_with_its_connection_is_had_by_sending_the_call_again(
        own_redis: RedisServer) -> None:
    """The connection breaks after the server ran the command and before its
    reply arrives (a proxy drops it): each way of calling sends it again on a
    new connection (every script is safe to repeat) and says so. A call
    waits for the second reply; several at once are all sent again; one
    whose reply was read later is sent again by whoever read it, and told
    its second reply as a repeat. The counts: the server ran each twice."""
    proxy = ReplyDroppingProxy(own_redis.port)
    admin = own_redis.client()
    keys = [f"count:{uuid.uuid4().hex}" for _ in range(5)]
    wire = _counting_wire(proxy.port)
    try:
        assert wire.call(COUNT, [keys[0]], []) == (1, False)
        proxy.drop_after = keys[1].encode()
        assert wire.call(COUNT, [keys[1]], []) == (2, True)
        proxy.drop_after = keys[2].encode()
        assert wire.call_many(COUNT, [([keys[2]], []), ([keys[2]], [])]) == ([3, 4], None)
        proxy.drop_after = keys[3].encode()
        told = Told()
        wire.call_later(COUNT, [keys[3]], [], told)
        wire.settle()  # reads the reply that never comes
        assert told.got == [(2, None, True)]
        # read by the next call instead: sent again, and so is that call
        proxy.drop_after = keys[4].encode()
        later = Told()
        wire.call_later(COUNT, [keys[4]], [], later)
        reply, repeated = wire.call(COUNT, [keys[0]], [])
        assert later.got == [(2, None, True)]
        assert repeated is True and str(reply) == admin.get(keys[0])
        assert [admin.get(k) for k in keys[1:]] == ["2", "4", "2", "2"]
        assert proxy.dropped == 4 and not wire.down and wire.discarded == 0
        _in_step(wire)
    finally:
        wire.close()
        proxy.close()


def test_replies_a_frozen_server_does_not_send_in_time_owe_a_release_and_tell_the_rest(
        own_redis: RedisServer) -> None:
    """Two calls sent without waiting to a frozen server (SIGSTOP), a release
    (``owe``) and another, then several calls at once that read their
    replies: none comes within the socket timeout. The calls fail with the
    timeout, not sent again, and an outage begins (so it does on wires
    that owed nothing, for several calls at once and for one); the release is
    kept, the other call told at once that it got no reply (it may yet run).
    Once the server runs again the release is sent and told its reply as a
    repeat, and calls go through."""
    admin = own_redis.client()
    owed_key, other_key, call_key = (f"count:{uuid.uuid4().hex}" for _ in range(3))
    wire, alone, single = (_counting_wire(own_redis.port, timeout=0.5) for _ in range(3))
    try:
        assert wire.call(COUNT, [call_key], []) == (1, False)
        for w in (alone, single):
            assert w.call(ECHO, [], ["connect"]) == ("connect", False)
        own_redis.pause()
        try:
            # nothing owed on their connections: the calls' own timeout begins it
            with pytest.raises(redis.TimeoutError) as timed_out:
                alone.call_many(COUNT, [([call_key], [])])
            assert not isinstance(timed_out.value, RedisUnanswered)
            with pytest.raises(redis.TimeoutError) as timed_out:
                single.call(COUNT, [call_key], [])
            assert not isinstance(timed_out.value, RedisUnanswered)
            for w in (alone, single):
                assert (w.down, w.outage.owed) == (True, 0)
            release, other = Told(), Told()
            wire.call_later(COUNT, [owed_key], [], release, owe=True)
            wire.call_later(COUNT, [other_key], [], other)
            assert wire.unsettled == 2
            with pytest.raises(redis.TimeoutError) as timed_out:
                wire.call_many(COUNT, [([call_key], []), ([call_key], [])])
            assert not isinstance(timed_out.value, RedisUnanswered)  # not sent twice
            assert (wire.down, wire.outage.owed) == (True, 1)
            ((reply, error, repeated),) = other.got
            assert reply is None and isinstance(error, redis.TimeoutError) and repeated
            assert release.got == [] and wire.unsettled == 0
        finally:
            own_redis.resume()
        assert release.told.wait(15), "the owed release was never sent"
        wait_for(lambda: not wire.down, 5, what="calls to go through again")
        # the frozen server ran what it had read too: the release ran twice,
        # the calls once each
        assert release.got == [(2, None, True)] and admin.get(owed_key) == "2"
        assert wire.outage.owed == 0 and len(other.got) == 1
        assert admin.get(other_key) == "1"
        wait_for(lambda: not (alone.down or single.down), 5,
                 what="the other wires' calls to go through")
        assert wire.call(COUNT, [call_key], []) == (6, False)
        assert wire.discarded == 0
        _in_step(wire)
    finally:
        for w in (wire, alone, single):
            w.close()


def test_calls_to_a_server_that_refuses_begin_an_outage_and_a_release_is_owed(
        own_redis: RedisServer) -> None:
    """The server is down before anything could be sent (the connection is
    refused). A release sent without waiting (``owe``) begins the outage and
    is kept, then sent once the server answers again, told its reply as a
    repeat; another call sent without waiting meanwhile is told at once that
    the server does not answer; several calls at once, or one, on a wire of
    their own fail with the refused connection and begin that wire's
    outage."""
    admin = own_redis.client()
    owed_key, other_key, many_key = (f"count:{uuid.uuid4().hex}" for _ in range(3))
    wire, fresh = _counting_wire(own_redis.port), _counting_wire(own_redis.port)
    plain = _counting_wire(own_redis.port)
    own_redis.stop()
    try:
        release = Told()
        wire.call_later(COUNT, [owed_key], [], release, owe=True)
        assert wire.down and wire.outage.owed == 1 and release.got == []
        other = Told()
        wire.call_later(COUNT, [other_key], [], other)
        ((reply, error, repeated),) = other.got
        assert reply is None and isinstance(error, RedisUnanswered) and repeated
        assert wire.outage.owed == 1 and wire.unsettled == 0
        with pytest.raises(redis.ConnectionError) as refused:
            fresh.call_many(COUNT, [([many_key], []), ([many_key], [])])
        assert not isinstance(refused.value, RedisUnanswered)
        assert fresh.down
        with pytest.raises(RedisUnanswered):
            fresh.call_many(COUNT, [([many_key], [])])
        with pytest.raises(redis.ConnectionError) as refused:
            plain.call(COUNT, [many_key], [])
        assert not isinstance(refused.value, RedisUnanswered) and plain.down
        own_redis.start()
        assert release.told.wait(15), "the owed release was never sent"
        wait_for(lambda: not (wire.down or fresh.down or plain.down), 5,
                 what="calls to go through again")
        assert release.got == [(1, None, True)] and len(other.got) == 1
        assert admin.get(owed_key) == "1" and admin.get(other_key) is None
        assert fresh.call_many(COUNT, [([many_key], []), ([many_key], [])]) == ([1, 2], None)
        assert plain.call(COUNT, [many_key], []) == (3, False)
        for w in (wire, fresh, plain):
            assert w.discarded == 0
            _in_step(w)
    finally:
        for w in (wire, fresh, plain):
            w.close()


def test_a_release_sent_without_waiting_that_a_demoted_primary_refuses_is_owed(
        own_redis: RedisServer) -> None:
    """Calls sent without waiting whose replies say a failover is under way
    (``READONLY``: the primary was demoted): a release (``owe``) is kept and
    sent once the server takes writes again, told its reply then; another
    call is told the error (it did not run, and is not a repeat). The same
    when the demoted server also lost the scripts: each call answers
    NOSCRIPT first, is sent again with its script, and gets READONLY."""
    admin = own_redis.client()
    keys = [f"count:{uuid.uuid4().hex}" for _ in range(4)]
    wire = _counting_wire(own_redis.port)
    try:
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        for lost_scripts in (False, True):
            owed_key, other_key = keys[2:] if lost_scripts else keys[:2]
            if lost_scripts:
                admin.script_flush()
            admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            other, release = Told(), Told()
            wire.call_later(COUNT, [other_key], [], other)
            wire.call_later(COUNT, [owed_key], [], release, owe=True)
            wire.settle()
            assert wire.down and wire.outage.owed == 1 and release.got == []
            ((reply, error, repeated),) = other.got
            assert reply is None and isinstance(error, redis.ReadOnlyError), other.got
            assert not repeated  # not sent twice: it never ran
            admin.execute_command("REPLICAOF", "NO", "ONE")
            assert release.told.wait(15), "the owed release was never sent"
            wait_for(lambda: not wire.down, 5, what="calls to go through again")
            assert release.got == [(1, None, True)]
            assert admin.get(owed_key) == "1" and admin.get(other_key) is None
        assert wire.discarded == 0
        _in_step(wire)
    finally:
        wire.close()


def test_the_first_deadline_of_a_wire_reads_the_servers_clock_once_it_answers(
        own_redis: RedisServer) -> None:
    """A request's deadline needs the server's clock: the first one a wire
    gives connects to learn it (a deadline a budget ahead of the server's
    clock), and later ones connect no more. Without a budget (no socket
    timeout) there is no deadline and nothing connects; a stopped server
    refuses that first connection (an outage begins), and while it does not
    answer the next try fails at once, connecting nothing."""
    server_ms = int(own_redis.client().time()[0]) * 1000
    wire = _counting_wire(own_redis.port, timeout=0.5)
    unbounded = Wire(redis.Redis(port=own_redis.port, decode_responses=True,
                                 socket_timeout=None), (COUNT,))
    try:
        deadline = wire.deadline_ms()
        assert server_ms + 500 <= deadline < server_ms + 500 + 60_000
        assert wire.connections == 1 and wire.clock.known
        assert wire.deadline_ms() >= deadline and wire.connections == 1
        assert (unbounded.deadline_ms(), unbounded.connections) == (0, 0)
        _in_step(wire)
    finally:
        wire.close()
        unbounded.close()
    own_redis.stop()
    refused = _counting_wire(own_redis.port)
    try:
        with pytest.raises(redis.ConnectionError) as first:
            refused.deadline_ms()
        assert not isinstance(first.value, RedisUnanswered) and refused.down
        with pytest.raises(RedisUnanswered):
            refused.deadline_ms()
        assert refused.connections == 1 and not refused.clock.known
    finally:
        own_redis.start()
        wait_for(lambda: not refused.down, 10, what="the refused wire's outage to end")
        refused.close()


def test_a_user_not_allowed_time_gets_no_deadline_and_keeps_the_replies_owed(
        own_redis: RedisServer) -> None:
    """An ACL user allowed the scripts but not ``TIME``: the wire never learns
    the server's clock, so requests go without a deadline (0), each asking
    anew on a connection of its own; replies owed to calls sent without
    waiting stay with their connection and are told."""
    admin = own_redis.client()
    admin.execute_command("ACL", "SETUSER", "notime", "on", ">pw", "~*", "+@all", "-time")
    key = f"count:{uuid.uuid4().hex}"
    wire = Wire(redis.Redis(port=own_redis.port, username="notime", password="pw",
                            decode_responses=True, socket_timeout=5), (COUNT,))
    try:
        assert wire.call(COUNT, [key], []) == (1, False)
        assert not wire.clock.known
        told = Told()
        wire.call_later(COUNT, [key], [], told)
        assert wire.deadline_ms() == 0 and wire.unsettled == 1
        wire.settle()
        assert told.got == [(2, None, False)] and admin.get(key) == "2"
        assert wire.discarded == 0 and not wire.clock.known
        _in_step(wire)
    finally:
        wire.close()


def test_plain_commands_written_at_once_read_every_reply_and_raise_the_first_error(
        own_redis: RedisServer) -> None:
    """The native path's calls: plain commands in one write (no script). Their
    replies come back as a list, one each (one command's alone); when some answer with an error,
    every reply is still read (the connection stays in step, the next call
    gets its own) and the first error is raised. The same for such calls
    sent without waiting: told the list, or the first error."""
    admin = own_redis.client()
    key, text = (f"cmd:{uuid.uuid4().hex}" for _ in range(2))
    admin.set(text, "not a number")
    wire = _counting_wire(own_redis.port)
    try:
        assert wire.call(COMMANDS, [], [("INCR", key), ("INCRBY", key, 2), ("GET", key)]) == (
            [1, 3, "3"], False)
        with pytest.raises(redis.ResponseError, match="not an integer") as first:
            wire.call(COMMANDS, [], [("INCR", key), ("INCR", text), ("INCR", key),
                                     ("HGET", text, "f"), ("INCR", key)])
        assert not isinstance(first.value, redis.exceptions.DataError)
        assert admin.get(key) == "6"  # every command ran
        assert wire.call(COMMANDS, [], [("INCR", key)]) == (7, False)  # one: its reply
        told, failed = Told(), Told()
        wire.call_later(COMMANDS, [], [("INCR", key), ("GET", key)], told)
        wire.call_later(COMMANDS, [], [("INCR", key), ("HGET", text, "f"), ("INCR", text)],
                        failed)
        assert wire.call(COUNT, [key], []) == (10, False)
        assert told.got == [([8, "8"], None, False)]
        ((reply, error, repeated),) = failed.got
        assert reply is None and not repeated and "WRONGTYPE" in str(error)
        assert wire.discarded == 0
        _in_step(wire)
    finally:
        wire.close()


def _reset(wire: Wire) -> bool:
    """The connection owing replies (a call sent without waiting on it) was
    reset by the server: TCP state CLOSE, the next write on it fails."""
    sock = wire._unsettled[-1][0].conn._sock
    return sock is not None and sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 7


def test_a_connection_the_server_closed_is_made_anew_and_what_was_sent_on_it_sent_again(
        own_redis: RedisServer) -> None:
    """The server closes the wire's idle connection (``CLIENT KILL``; a
    ``timeout`` setting, a proxy dropping idle connections); a call sent
    without waiting is written on it and never reaches the server, which
    resets the connection. The next write on it fails: the call that made it
    (a call, several at once, another sent without waiting) sends what was
    owed on it again once it is connected anew, each told its reply as a repeat,
    then itself; no outage begins. The counts: each ran once."""
    admin = own_redis.client()
    keys = [f"count:{uuid.uuid4().hex}" for _ in range(7)]
    wire = _counting_wire(own_redis.port)
    try:
        assert wire.call(COUNT, [keys[0]], []) == (1, False)
        made = wire.connections

        def killed_then_sent_later(key: str) -> Told:
            assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
            told = Told()
            wire.call_later(COUNT, [key], [], told)
            wait_for(lambda: _reset(wire), 5, what="the server to reset the connection")
            assert told.got == []
            return told

        told = killed_then_sent_later(keys[1])
        assert wire.call(COUNT, [keys[2]], []) == (1, True)
        assert told.got == [(1, None, True)]
        told = killed_then_sent_later(keys[3])
        assert wire.call_many(COUNT, [([keys[4]], []), ([keys[4]], [])]) == ([1, 2], None)
        assert told.got == [(1, None, True)]
        told = killed_then_sent_later(keys[5])
        last = Told()
        wire.call_later(COUNT, [keys[6]], [], last)
        assert told.got == [(1, None, True)] and last.got == [(1, None, True)]
        assert [admin.get(k) for k in keys] == ["1", "1", "1", "1", "2", "1", "1"]
        assert not wire.down and wire.discarded == 0
        assert wire.connections == made  # the same connection, connected anew
        wire.settle()
        _in_step(wire)
    finally:
        wire.close()


class Interrupt(BaseException):
    """What a signal handler raises in the middle of a call (a Ctrl-C, a
    shutdown): not an error of the call, and nothing of the wire catches it."""


class Interrupting(redis.connection.Connection):
    """A connection whose next write (``interrupt_send``) or next read
    (``interrupt_read``) is interrupted."""

    interrupt_send = False
    interrupt_read = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if Interrupting.interrupt_send:
            Interrupting.interrupt_send = False
            raise Interrupt()
        super().send_packed_command(command, check_health)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if Interrupting.interrupt_read:
            Interrupting.interrupt_read = False
            raise Interrupt()
        return super().read_response(*args, **kwargs)


def test_a_call_interrupted_between_its_reads_leaves_no_reply_to_the_next(
        own_redis: RedisServer) -> None:
    """A call is interrupted while replies are still owed on its connection
    (here by the handler of a reply read before its own; a write
    interrupted likewise): the connection is closed, never reused, and
    counted as discarded when a reply was left on it; the next call gets its
    own reply. A call sent without waiting whose reply was owed on a write
    that was interrupted is told so (it may have run), and so is one whose
    reply the next call was reading when it was interrupted (a soft time
    limit raised into the task), or whose reply came after one whose handler
    was interrupted (before, neither was ever told)."""

    def interrupted(reply: Any, error: Any, repeated: bool) -> None:
        raise Interrupt()

    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=Interrupting, port=own_redis.port, decode_responses=True,
        socket_timeout=5))
    wire = Wire(client, (ECHO,))
    try:
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        wire.call_later(ECHO, [], ["a"], interrupted)
        with pytest.raises(Interrupt):
            wire.call(ECHO, [], ["b"])
        assert wire.discarded == 1 and wire.call(ECHO, [], ["c"]) == ("c", False)
        wire.call_later(ECHO, [], ["d"], interrupted)
        with pytest.raises(Interrupt):
            wire.call_many(ECHO, [([], ["e"])])
        assert wire.discarded == 2 and wire.call(ECHO, [], ["f"]) == ("f", False)
        before, after = Told(), Told()
        wire.call_later(ECHO, [], ["f2"], before)
        wire.call_later(ECHO, [], ["g"], interrupted)
        wire.call_later(ECHO, [], ["h"], after)
        with pytest.raises(Interrupt):
            wire.settle()  # closed as broken: not counted
        # the call behind the interrupted handler is told its reply went unread;
        # the one before it was told its reply, once
        ((reply, error, repeated),) = after.got
        assert reply is None and repeated and isinstance(error, redis.ConnectionError)
        assert [got[0] for got in before.got] == ["f2"]
        assert wire.discarded == 2 and wire.call(ECHO, [], ["i"]) == ("i", False)
        told = Told()
        wire.call_later(ECHO, [], ["j"], told)
        Interrupting.interrupt_send = True
        with pytest.raises(Interrupt):
            wire.call(ECHO, [], ["k"])
        ((reply, error, repeated),) = told.got
        assert reply is None and repeated and isinstance(error, redis.ConnectionError)
        assert str(error).startswith("the connection was closed before the reply was read")
        assert wire.discarded == 2 and wire.call(ECHO, [], ["l"]) == ("l", False)
        told = Told()
        wire.call_later(ECHO, [], ["m"], told)
        Interrupting.interrupt_read = True  # as the next call reads m's reply
        with pytest.raises(Interrupt):
            wire.call(ECHO, [], ["n"])
        ((reply, error, repeated),) = told.got
        assert reply is None and repeated and isinstance(error, redis.ConnectionError)
        assert str(error).startswith("the connection was closed before the reply was read")
        assert wire.call(ECHO, [], ["o"]) == ("o", False)
        _in_step(wire)
    finally:
        Interrupting.interrupt_send = Interrupting.interrupt_read = False
        wire.close()


def test_a_call_whose_connection_breaks_twice_is_not_sent_a_third_time(
        own_redis: RedisServer) -> None:
    """A call (or several at once) whose reply is lost, then lost again on the
    new connection that sent it again: it fails with that connection's error
    and begins an outage, after two runs on the server, not three; once the
    probe hears the server calls go through."""
    proxy = ReplyDroppingProxy(own_redis.port)
    admin = own_redis.client()
    one, many = (f"count:{uuid.uuid4().hex}" for _ in range(2))
    wire = _counting_wire(proxy.port)
    try:
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        for key, call in ((one, lambda k: wire.call(COUNT, [k], [])),
                          (many, lambda k: wire.call_many(COUNT, [([k], [])]))):
            proxy.drop_after, proxy.drops_left = key.encode(), 2
            with pytest.raises(redis.ConnectionError) as broken:
                call(key)
            # the second connection's own error, not one made up after it
            assert str(broken.value) == "Connection closed by server."
            assert admin.get(key) == "2" and proxy.drops_left == 0
            wait_for(lambda: not wire.down, 10, what="the probe to hear the server")
        assert proxy.dropped == 4 and wire.discarded == 0
        assert wire.call(COUNT, [one], []) == (3, False)
        _in_step(wire)
    finally:
        wire.close()
        proxy.close()


class InterruptedConnect(redis.connection.Connection):
    """A connection interrupted as it connects (``interrupt``): after the
    wire's connect callback wrote its ``SCRIPT LOAD`` commands and ``TIME``,
    before it read their replies. redis-py leaves such a connection open (it
    closes one only on an error of its own, and runs the callbacks outside
    that), with those replies unread."""

    interrupt = False

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        super().send_command(*args, **kwargs)
        if InterruptedConnect.interrupt and str(args[0]).upper() == "TIME":
            InterruptedConnect.interrupt = False
            raise Interrupt()


def test_a_call_interrupted_while_its_connection_connects_leaves_no_reply_to_the_next(
        own_redis: RedisServer) -> None:
    """A call (several at once, one, one sent without waiting) interrupted
    while its connection connects, its replies of the connect still unread:
    the connection is closed, never reused as it is, so the next call
    connects anew and gets its own reply, not the connect's. Nothing was
    owed on it: nothing is told, nothing counted as discarded."""
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=InterruptedConnect, port=own_redis.port, decode_responses=True,
        socket_timeout=5))
    wire = Wire(client, (ECHO, COUNT))
    told = Told()
    calls = (lambda: wire.call_many(ECHO, [([], ["a"]), ([], ["b"])]),
             lambda: wire.call(ECHO, [], ["c"]),
             lambda: wire.call_later(ECHO, [], ["d"], told))
    try:
        for call in calls:
            InterruptedConnect.interrupt = True
            with pytest.raises(Interrupt):
                call()
            assert not InterruptedConnect.interrupt
        assert wire.call_many(ECHO, [([], ["e"]), ([], ["f"])]) == (["e", "f"], None)
        assert wire.call(ECHO, [], ["g"]) == ("g", False)
        assert told.got == [] and wire.unsettled == 0
        assert wire.connections == 1 and wire.discarded == 0 and not wire.down
        _in_step(wire)
    finally:
        InterruptedConnect.interrupt = False
        wire.close()


def test_settling_with_a_frozen_server_begins_the_outage(own_redis: RedisServer) -> None:
    """``settle`` reads the reply of a call sent without waiting (not a
    release) from a frozen server (SIGSTOP): none comes within the socket
    timeout. The call is told so (it may yet run), and the outage begins
    there, though no call of the wire's own was waiting: the next call fails
    at once, not sent, instead of waiting out a timeout of its own."""
    admin = own_redis.client()
    key, other = (f"count:{uuid.uuid4().hex}" for _ in range(2))
    wire = _counting_wire(own_redis.port, timeout=0.5)
    try:
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        own_redis.pause()
        try:
            told = Told()
            wire.call_later(COUNT, [key], [], told)
            wire.settle()
            ((reply, error, repeated),) = told.got
            assert reply is None and isinstance(error, redis.TimeoutError) and repeated
            assert wire.down and wire.outage.owed == 0 and wire.unsettled == 0
            with pytest.raises(RedisUnanswered):
                wire.call(COUNT, [other], [])
        finally:
            own_redis.resume()
        wait_for(lambda: not wire.down, 10, what="the probe to hear the server")
        assert admin.get(key) in (None, "1") and admin.get(other) is None  # never sent again
        assert wire.call(COUNT, [other], []) == (1, False) and len(told.got) == 1
        assert wire.discarded == 0
        _in_step(wire)
    finally:
        wire.close()


def test_settle_reads_nothing_while_an_outage_is_on(own_redis: RedisServer) -> None:
    """A call sent without waiting to a frozen server (SIGSTOP), then an
    outage begun elsewhere on the wire: here the first deadline of a user
    not allowed ``TIME``, which connects anew and gets no reply in time.
    ``settle`` then reads nothing (it would wait out a timeout on a server
    known not to answer): the call stays owed, untold, and is read once the
    server answers again, told its reply then."""
    admin = own_redis.client()
    admin.execute_command("ACL", "SETUSER", "notime", "on", ">pw", "~*", "+@all", "-time")
    key = f"count:{uuid.uuid4().hex}"
    wire = Wire(redis.Redis(port=own_redis.port, username="notime", password="pw",
                            decode_responses=True, socket_timeout=0.5), (COUNT,))
    try:
        assert wire.call(COUNT, [key], []) == (1, False) and not wire.clock.known
        told = Told()
        own_redis.pause()
        try:
            wire.call_later(COUNT, [key], [], told)
            with pytest.raises(redis.TimeoutError):
                wire.deadline_ms()
            # a connection of its own: the first one still owes the reply
            assert wire.down and wire.unsettled == 1 and wire.connections == 2
            wire.settle()
            assert told.got == [] and wire.unsettled == 1
        finally:
            own_redis.resume()
        wait_for(lambda: not wire.down, 10, what="the probe to hear the server")
        wire.settle()
        assert told.got == [(2, None, False)] and admin.get(key) == "2"
        assert wire.unsettled == 0 and wire.discarded == 0 and wire.connections == 2
        _in_step(wire)
    finally:
        wire.close()


def test_commands_of_their_own_writer_are_written_from_their_keys(
        own_redis: RedisServer) -> None:
    """A call of plain commands that writes itself from its KEYS and ARGV (the
    native grant: the lock, its fencing counter and its finish marker) gets
    its keys: the lock is taken, the counter set, one reply read for each."""
    admin = own_redis.client()
    lock, fence, fin = (f"grant:{uuid.uuid4().hex}" for _ in range(3))
    wire = _counting_wire(own_redis.port)
    try:
        (held, ttl, counter, finished, clock), repeated = wire.call(
            GRANT, [lock, fence, fin], ["record", 30_000, 7, 60_000])
        assert (held, counter, finished, repeated) == (None, None, None, False)
        assert 0 < ttl <= 30_000 and len(clock) == 2
        assert admin.get(lock) == "record" and admin.get(fence) == "7"
        assert wire.call(ECHO, [], ["next"]) == ("next", False)
        _in_step(wire)
    finally:
        wire.close()


def test_a_user_not_allowed_script_load_calls_the_scripts_loaded_for_it(
        own_redis: RedisServer) -> None:
    """An ACL user allowed ``EVALSHA`` but not ``SCRIPT`` (the scripts loaded
    for it by another user, at deploy time): each connect's ``SCRIPT LOAD``
    is refused, which the wire passes over, reading the server's clock all
    the same; its calls run the scripts there, the ways of calling each get
    their own reply. Once the server loses them, a call says it may not load
    them (``NOPERM``), and the next call is still in step."""
    admin = own_redis.client()
    for script in (COUNT, ECHO):
        admin.script_load(script.source)
    admin.execute_command("ACL", "SETUSER", "noload", "on", ">pw", "~*", "+@all", "-script")
    key = f"count:{uuid.uuid4().hex}"
    wire = Wire(redis.Redis(port=own_redis.port, username="noload", password="pw",
                            decode_responses=True, socket_timeout=5), (COUNT, ECHO))
    try:
        assert wire.call(COUNT, [key], []) == (1, False)
        assert wire.clock.known and wire.connections == 1
        assert wire.call_many(COUNT, [([key], []), ([key], [])]) == ([2, 3], None)
        told = Told()
        wire.call_later(COUNT, [key], [], told)
        wire.settle()
        assert told.got == [(4, None, False)] and admin.get(key) == "4"
        admin.script_flush()
        with pytest.raises(redis.exceptions.NoPermissionError):
            wire.call(COUNT, [key], [])
        assert admin.get(key) == "4"
        admin.script_load(COUNT.source)
        assert wire.call(COUNT, [key], []) == (5, False)
        assert wire.discarded == 0 and not wire.down
        _in_step(wire)
    finally:
        wire.close()


def test_a_command_sent_before_a_call_that_fails_is_logged_and_the_call_answered(
        own_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """The command sent before a script in the same write (``ASKING`` after
    an ASK redirection) answers with an error, the script normally: the call
    gets its reply, and the failed command is logged, naming it."""
    wire = _counting_wire(own_redis.port)
    try:
        with caplog.at_level("WARNING", logger="celery_singleton_lock"):
            assert wire.call_with(ECHO, [], ["x"], before=("EVAL", FAIL.source, 0, "ERR no")
                                  ) == ("x", False, None)
        (record,) = caplog.records
        assert record.levelname == "WARNING" and "EVAL" in record.getMessage()
        assert wire.call(ECHO, [], ["y"]) == ("y", False)
        _in_step(wire)
    finally:
        wire.close()


#: a script that counts its runs in its key, and where it may not write (a
#: replica) says so with an error that is no failover's (``ERR closed``)
COUNT_OR_CLOSED = _script("count_or_closed",
                          "local n = redis.pcall('INCR', KEYS[1]) "
                          "if type(n) == 'table' and n.err then "
                          "return redis.error_reply('ERR closed') end return n")


class Held(redis.connection.Connection):
    """A connection whose reply to the next write holding ``armed`` is held:
    ``reached`` is set as its read begins, and it is read once ``go`` is."""

    armed: Optional[bytes] = None
    reached = threading.Event()
    go = threading.Event()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        armed = Held.armed
        if armed is not None and any(armed in bytes(item) for item in command):
            Held.armed = None
            self.hold = True
        super().send_packed_command(command, check_health)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self.hold:
            self.hold = False
            Held.reached.set()
            assert Held.go.wait(30), "the held reply was never let go"
        return super().read_response(*args, **kwargs)


def test_a_release_sent_again_that_fails_while_another_threads_outage_begins_is_owed(
        own_redis: RedisServer) -> None:
    """A release sent without waiting answers NOSCRIPT, and the primary is
    demoted; ``settle`` (in a thread of its own) sends it again. While it
    waits for that reply, another thread's call begins an outage (the
    engine owes the undo of a grant that got no reply; the demoted server
    refuses it, READONLY: the outage stays on). The release's reply is an
    error that is no failover's: it is owed all the same, kept behind the
    undo rather than told the error, since the outage is on. Once the
    server takes writes again, both are sent, and the release is told its
    reply as a repeat."""
    admin = own_redis.client()
    undo_key, release_key = (f"count:{uuid.uuid4().hex}" for _ in range(2))
    Held.armed, Held.reached, Held.go = None, threading.Event(), threading.Event()
    client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=Held, port=own_redis.port, decode_responses=True, socket_timeout=5))
    wire = Wire(client, (ECHO, COUNT, COUNT_OR_CLOSED))
    settling: Optional[threading.Thread] = None
    try:
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        admin.script_flush()
        told = Told()
        wire.call_later(COUNT_OR_CLOSED, [release_key], [], told, owe=True)
        admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        Held.armed = COUNT_OR_CLOSED.sha.encode()  # the release sent again, on a new connection
        settling = threading.Thread(target=wire.settle, daemon=True)
        settling.start()
        assert Held.reached.wait(15), "the release was never sent again"
        wire.owe(redis.ConnectionError("no reply"), COUNT, [undo_key], [])
        assert wire.down
        Held.go.set()
        settling.join(15)
        assert not settling.is_alive()
        assert told.got == [] and wire.down and wire.outage.owed == 2
        admin.execute_command("REPLICAOF", "NO", "ONE")
        assert told.told.wait(15), "the owed release was never sent"
        assert told.got == [(1, None, True)] and admin.get(release_key) == "1"
        assert admin.get(undo_key) == "2"  # the undo: sent twice
        wait_for(lambda: not wire.down, 10, what="calls to go through again")
        assert wire.call(ECHO, [], ["next"]) == ("next", False)
        _in_step(wire)
    finally:
        Held.armed = None
        Held.go.set()
        if settling is not None:
            settling.join(15)
        wire.close()


def test_a_sentinel_wire_reconnects_its_idle_connections_to_the_promoted_primary() -> None:
    """A wire to a Sentinel-managed primary, holding two idle connections
    (a call made while another's reply was being handled took one of its
    own). The primary freezes (SIGSTOP): a call gets no reply, an outage
    begins. The sentinels promote the replica; the probe, asking them where
    the primary is on every try, hears it. Calls go through again, on
    either connection: the one still open to the frozen old primary is
    closed as the outage ends, and reconnects where the sentinels say. The
    wire names the service and where it is."""
    group = SentinelGroup().start()
    frozen: Optional[RedisServer] = None
    wire: Optional[Wire] = None
    try:
        sentinel = redis.Sentinel([("127.0.0.1", s.port) for s in group.sentinels],
                                  socket_timeout=0.5)
        wire = Wire(sentinel.master_for(group.master, socket_timeout=0.5,
                                        decode_responses=True), (COUNT, ECHO))
        assert wire.call(ECHO, [], ["connect"]) == ("connect", False)
        assert wire.name.startswith(f"Sentinel primary {group.master!r} (127.0.0.1:")
        inside: list[Any] = []
        w = wire
        wire.call_later(ECHO, [], ["first"],
                        lambda *_: inside.append(w.call(ECHO, [], ["inside"])))
        wire.settle()
        assert inside == [("inside", False)] and wire.connections == 2
        old_port = group.master_port()
        assert old_port is not None
        frozen = group.server_on(old_port)
        frozen.pause()
        key = f"count:{uuid.uuid4().hex}"
        with pytest.raises(redis.TimeoutError):
            wire.call(COUNT, [key], [])
        assert wire.down
        new_port = wait_for(lambda: (p := group.master_port()) not in (None, old_port) and p,
                            30, interval=0.1, what="the sentinels to promote the replica")
        promoted = group.server_on(int(new_port))
        wait_for(lambda: promoted.client().info("replication")["role"] == "master", 30,
                 what="the replica to take writes")
        wait_for(lambda: not wire.down, 30, what="the probe to hear the promoted primary")
        # the call whose reply is read takes the connection that timed out;
        # the one made inside its handler, the other
        inside.clear()
        wire.call_later(ECHO, [], ["again"],
                        lambda *_: inside.append(w.call(COUNT, [key], [])))
        wire.settle()
        assert inside == [(1, False)] and wire.connections == 2
        assert wire.call_many(COUNT, [([key], []), ([key], [])]) == ([2, 3], None)
        assert promoted.client().get(key) == "3"
        assert wire.name == f"Sentinel primary {group.master!r} (127.0.0.1:{new_port})"
        _in_step(wire)
    finally:
        if frozen is not None:
            frozen.resume()
        if wire is not None:
            wire.close()
        group.cleanup()
