"""The wire's own reply reader (:mod:`celery_singleton_lock.engine.link`) against a
real redis-server: every kind of reply in both protocols comes out as
redis-py's own reader gives it, replies cut anywhere by the network are read whole,
and the faults come out as redis-py's exceptions with the connection dropped."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Iterator

import pytest
import redis
import redis.connection
from redis.exceptions import NoScriptError

from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine.link import Link
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.scripts import pack
from celery_singleton_lock.keys import LockKeys
from tests.support import RedisServer, missing

REDIS_PY = tuple(int(p) for p in redis.__version__.split(".")[:2])
#: RESP3 in redis-py: from 5.0
PROTOCOLS = [2, 3] if REDIS_PY >= (5, 0) else [2]

#: commands whose replies cover every kind a server sends: simple and bulk
#: strings, nil, integers, arrays nested and empty, error replies inside an
#: array, and in RESP3 maps, sets, doubles, booleans, nulls and verbatim text
COMMANDS: list[tuple[Any, ...]] = [
    ("PING",),
    ("SET", "k:s", "välue"),
    ("GET", "k:s"),
    ("GET", "k:missing"),
    ("INCRBY", "k:n", -7),
    ("RPUSH", "k:l", "a", "", "c"),
    ("LRANGE", "k:l", 0, -1),
    ("LRANGE", "k:missing", 0, -1),
    ("HSET", "k:h", "f1", "v1", "f2", "2"),
    ("HGETALL", "k:h"),
    ("SADD", "k:set", "x", "y"),
    ("SMEMBERS", "k:set"),
    ("ZADD", "k:z", "1.5", "m"),
    ("ZSCORE", "k:z", "m"),
    ("EVAL", "return {1, 'two', {3, false}, true, redis.status_reply('OK')}", 0),
    ("EVAL", "return redis.pcall('INCR', KEYS[1])", 1, "k:s"),
    ("EVAL", "return {redis.pcall('INCR', KEYS[1]), 5}", 1, "k:s"),
    ("EVAL", "redis.setresp(3); return redis.call('HGETALL', KEYS[1])", 1, "k:h"),
    ("EVAL", "redis.setresp(3); return {double=3.25}", 0),
    ("EVAL", "redis.setresp(3); return redis.call('EXISTS', KEYS[1]) == 0", 1, "k:b"),
    ("EVAL", "redis.setresp(3); return redis.call('EXISTS', KEYS[1]) == 1", 1, "k:b"),
    ("EVAL", "redis.setresp(3); return {big_number='1234567890123456789012'}", 0),
    ("CLIENT", "INFO"),
]


def _connection(server: RedisServer, protocol: int, decode: bool, port: int = 0,
                connect: bool = True, **kw: Any) -> Any:
    """A redis-py connection to ``server`` (or to ``port``: a path to it)."""
    options: dict[str, Any] = {"host": "127.0.0.1", "port": port or server.port,
                               "decode_responses": decode, **kw}
    if REDIS_PY >= (5, 0):
        options["protocol"] = protocol
    conn = redis.connection.Connection(**options)
    if connect:
        conn.connect()
    return conn


def _python_parser(protocol: int) -> Any:
    """redis-py's own reader (hiredis, when installed, gives a RESP3 big number
    as text where redis-py's own gives an int; the wire follows redis-py's own)."""
    if REDIS_PY < (5, 0):
        return redis.connection.PythonParser  # type: ignore[attr-defined]
    from redis._parsers import _RESP2Parser, _RESP3Parser

    return _RESP3Parser if protocol == 3 else _RESP2Parser


def _assert_every_kind_as_from_redis_py(server: RedisServer, theirs: Any, link: Link) -> None:
    """Every command of COMMANDS on a fresh server, through redis-py's reader
    and through ``link``: the same replies and errors."""
    server.client().flushall()
    expected = [_redis_py_reply(theirs, command) for command in COMMANDS]
    server.client().flushall()
    got = [_link_reply(link, command) for command in COMMANDS]
    for command, ours, reference in zip(COMMANDS, got, expected):
        if command[:2] == ("CLIENT", "INFO"):  # names its own connection
            assert type(ours) is type(reference) and "id=" in str(ours)
            continue
        assert _same(ours, reference), (command, ours, reference)


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, Exception) or isinstance(theirs, Exception):
        return type(ours) is type(theirs) and str(ours) == str(theirs)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(map(_same, ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def _redis_py_reply(conn: Any, command: tuple[Any, ...]) -> Any:
    conn.send_command(*command)
    try:
        return conn.read_response()
    except redis.ResponseError as exc:
        return exc


def _link_reply(link: Link, command: tuple[Any, ...]) -> Any:
    link.send(pack(command))
    try:
        return link.read()
    except redis.ResponseError as exc:
        return exc


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_kind_of_reply_comes_out_as_from_redis_py(own_redis: RedisServer, protocol: int,
                                                          decode: bool) -> None:
    theirs = _connection(own_redis, protocol, decode, parser_class=_python_parser(protocol))
    link = Link(_connection(own_redis, protocol, decode))
    assert link.here
    try:
        _assert_every_kind_as_from_redis_py(own_redis, theirs, link)
        # the error replies above left the connection in step
        assert _link_reply(link, ("ECHO", "still in step")) == (
            "still in step" if decode else b"still in step")
    finally:
        theirs.disconnect()
        link.disconnect()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_replies_cut_by_the_network_anywhere_are_read_whole(own_redis: RedisServer,
                                                             protocol: int) -> None:
    """Two thousand replies in one write, and one larger than a read: the
    reads end inside replies, inside length lines, between CR and LF."""
    client = own_redis.client()
    client.set("big", "x" * 300_000)
    client.set("small", "y" * 97)
    link = Link(_connection(own_redis, protocol, True))
    try:
        link.send(b"".join(pack(("GET", "small")) for _ in range(2000))
                  + pack(("GET", "big")) + pack(("INCR", "n")), 2002)
        replies = [link.read() for _ in range(2002)]
        assert replies[:2000] == ["y" * 97] * 2000
        assert replies[2000] == "x" * 300_000
        assert replies[2001] == 1
    finally:
        link.disconnect()


class _TricklingProxy:
    """A TCP path to a local Redis that hands the server's bytes to the
    client one at a time: every reply arrives in many reads."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                server = socket.create_connection(("127.0.0.1", self.target_port))
                threading.Thread(target=self._pipe, args=(client, server, False),
                                 daemon=True).start()
                threading.Thread(target=self._pipe, args=(server, client, True),
                                 daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, trickle: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not trickle:
                    dst.sendall(data)
                    continue
                for i in range(len(data)):
                    dst.sendall(data[i:i + 1])
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def trickling(own_redis: RedisServer) -> Iterator[_TricklingProxy]:
    proxy = _TricklingProxy(own_redis.port)
    yield proxy
    proxy.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_replies_arriving_a_byte_at_a_time_are_read_whole(own_redis: RedisServer,
                                                           trickling: _TricklingProxy,
                                                           protocol: int) -> None:
    theirs = _connection(own_redis, protocol, True, parser_class=_python_parser(protocol))
    link = Link(_connection(own_redis, protocol, True, port=trickling.port, connect=False))
    try:
        _assert_every_kind_as_from_redis_py(own_redis, theirs, link)
    finally:
        theirs.disconnect()
        link.disconnect()


def test_error_replies_are_redis_pys_exceptions_and_the_connection_stays_in_step(
        own_redis: RedisServer) -> None:
    link = Link(_connection(own_redis, 2, True))
    try:
        link.send(pack(("EVALSHA", "0" * 40, 0)))
        with pytest.raises(NoScriptError):
            link.read()
        link.send(pack(("EVAL", "return redis.error_reply('READONLY not now')", 0)))
        with pytest.raises(redis.ReadOnlyError):
            link.read()
        link.send(pack(("NOSUCHCOMMAND",)))
        with pytest.raises(redis.ResponseError, match="unknown command"):
            link.read()
        assert link.conn._sock is not None  # an error reply is a reply: still connected
        link.send(pack(("PING",)))
        assert link.read() == "PONG"
    finally:
        link.disconnect()


def test_a_connection_closed_by_the_server_is_a_connection_error_then_reconnects(
        own_redis: RedisServer) -> None:
    link = Link(_connection(own_redis, 2, True))
    try:
        link.send(pack(("CLIENT", "ID")))
        own_id = link.read()
        own_redis.client().client_kill_filter(_id=own_id)
        link.send(pack(("PING",)))
        with pytest.raises(redis.ConnectionError):
            link.read()
        assert link.conn._sock is None  # dropped, as redis-py drops it
        link.send(pack(("PING",)))  # connects again
        assert link.read() == "PONG"
    finally:
        link.disconnect()


def test_no_reply_in_time_is_a_timeout_error_and_the_connection_is_dropped(
        own_redis: RedisServer) -> None:
    link = Link(_connection(own_redis, 2, True, socket_timeout=0.5))
    own_redis.pause()
    try:
        link.send(pack(("PING",)))
        with pytest.raises(redis.TimeoutError):
            link.read()
        assert link.conn._sock is None
    finally:
        own_redis.resume()
        link.disconnect()
    link.send(pack(("PING",)))
    assert link.read() == "PONG"
    link.disconnect()


def test_a_push_message_reaches_redis_pys_handler_and_the_reply_after_it_is_read(
        own_redis: RedisServer) -> None:
    if REDIS_PY < (5, 0):
        missing("redis-py before 5.0 has no RESP3 push messages")
    pushed: list[Any] = []
    conn = _connection(own_redis, 3, True)
    conn._parser.invalidation_push_handler_func = pushed.append
    link = Link(conn)
    try:
        link.send(pack(("CLIENT", "TRACKING", "on")))
        assert link.read() == "OK"
        link.send(pack(("GET", "tracked")))
        assert link.read() is None
        own_redis.client().set("tracked", "changed")  # the server pushes an invalidation
        link.send(pack(("PING",)))
        assert link.read() == "PONG"
        assert pushed and pushed[0][0] == "invalidate" and pushed[0][1] == ["tracked"]
    finally:
        link.disconnect()


def test_a_connection_class_that_reads_its_own_way_is_read_by_redis_py(
        own_redis: RedisServer) -> None:
    class Watching(redis.connection.Connection):
        seen = 0

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            Watching.seen += 1
            return super().read_response(*args, **kwargs)

    from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

    sentinel_pool = SentinelConnectionPool("primary", Sentinel([]))
    assert not Link(SentinelManagedConnection(connection_pool=sentinel_pool)).here
    link = Link(Watching(host="127.0.0.1", port=own_redis.port, decode_responses=True))
    assert not link.here
    try:
        link.send(pack(("PING",)))  # connects: the handshake's replies are read by redis-py too
        seen = Watching.seen
        assert link.read() == "PONG"
        assert Watching.seen == seen + 1
    finally:
        link.disconnect()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_lock_engines_calls_are_read_here(own_redis: RedisServer, protocol: int) -> None:
    options = {"protocol": protocol} if REDIS_PY >= (5, 0) else {}
    engine = connect(SingletonConfig.defaults(own_redis.url(), redis_options=options))
    keys = LockKeys("singleton:", "link-test")
    try:
        answer = engine.acquire(keys, Request(task_id="t", exec_id="e", lease=Lease.of_ms(60_000),
                                              hostname="h", retries=0,
                                              task_name="n"))
        assert answer.token
        assert engine.release(keys, "e", "t")
        links = engine.wire._idle  # type: ignore[union-attr]
        assert links and all(link.here for link in links)
    finally:
        engine.wire.close()
