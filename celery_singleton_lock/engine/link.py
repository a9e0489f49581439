"""One connection of the wire: commands written on its socket, replies read
off it and parsed here.

A task's lock is two calls with short replies. redis-py reaches each reply
through its connection's wrapping, a socket buffer and a parser written for
every kind of reply; parsing them here costs less CPU (docs/benchmarks.md,
the task's own process). What comes out is what redis-py's own reader gives:
bulk strings decoded as the client says (``decode_responses``), an error
reply parsed by the connection's own parser (so NOSCRIPT, READONLY, MOVED and
ASK are redis-py's classes), a timeout as :class:`redis.TimeoutError` and a
lost connection as :class:`redis.ConnectionError`, the connection
disconnected on both, as redis-py does.

Both protocols are read (RESP2, and RESP3, which redis-py 8.1 speaks by default: a
push message goes to the parser's push handlers, as redis-py's reader would
send it). redis-py still connects (handshake, AUTH, our scripts loaded in the
connect callback: every reply read before the first command here), and reads
for a connection whose class reads replies its own way (Sentinel's turns
READONLY into a failover).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Any

import redis
import redis.connection
import redis.exceptions

#: how much one read off the socket takes at most (as redis-py's reader)
READ_SIZE = 65536
#: SO_LINGER on, 0 s: a close resets the connection, unsent bytes dropped
_ABORT_ON_CLOSE = struct.pack("ii", 1, 0)

_CRLF = b"\r\n"


def _parses_here(conn: Any) -> bool:
    """Whether this connection's replies can be read here: redis-py's own
    reading and writing (a subclass may watch its replies)."""
    base = redis.connection.Connection
    kind = type(conn)
    return (kind.read_response is base.read_response
            and kind.send_packed_command is base.send_packed_command)


class Link:
    """A redis-py connection written and read by the wire."""

    __slots__ = ("_buf", "_decode", "_encoding", "_errors", "_pos", "_resolving", "_sock",
                 "conn", "here", "owed")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        #: read here (else by redis-py: see the module's text)
        self.here = _parses_here(conn)
        # a Sentinel-managed connection learns the primary's address in
        # connect(); a reconnect on send would go to the address it had
        self._resolving = hasattr(conn, "connect_to")
        encoder = conn.encoder
        self._decode = bool(encoder.decode_responses)
        self._encoding = encoder.encoding
        self._errors = encoder.encoding_errors
        self._sock: Any = None
        self._buf = b""
        self._pos = 0
        #: replies the server owes on this connection: sent for, not read yet.
        #: A connection goes back to its wire's idle list only at 0; any other
        #: count is closed instead (:meth:`.wire.Wire._give`), so no call ever
        #: reads a reply that was another call's
        self.owed = 0

    def send(self, packed: bytes, replies: int = 1) -> None:
        """Write ``packed``, which gets ``replies`` replies, connecting first
        when not connected (a Sentinel-managed connection asks for the
        primary's address then)."""
        conn = self.conn
        sock = conn._sock
        if sock is None:
            self._connect()
            sock = conn._sock
        if sock is not self._sock:  # a new socket: nothing of the old one is owed
            self._sock = sock
            self._buf = b""
            self._pos = 0
            self.owed = 0
        if not self.here:
            self.owed += replies
            try:
                conn.send_packed_command([packed], check_health=False)
            except BaseException:
                self.owed = 0  # redis-py disconnected it
                raise
            return
        self.owed += replies
        try:
            sock.sendall(packed)
        except socket.timeout:
            self.disconnect()
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            self.disconnect()
            raise redis.ConnectionError(f"Error while writing to socket: {exc}") from None
        except BaseException:
            self.disconnect()  # part of it may have left
            raise

    def ensure(self) -> None:
        """Connect now, if not connected (the handshake's replies are read by
        redis-py: nothing is owed after it)."""
        if self.conn._sock is None:
            self._connect()

    def _connect(self) -> None:
        """Connect as redis-py's send would (no health check of a connection
        just made), a Sentinel-managed one through ``connect()``.

        The socket drops what it has not sent yet when it is closed
        (``SO_LINGER`` 0): a call given up on (no reply in time) closes its
        connection, and a request still in the kernel's send queue must not
        reach the server later, when its caller is long gone (a grant nobody
        holds). Replies are read before any close that is not an abandon."""
        conn = self.conn
        if self._resolving or not hasattr(conn, "connect_check_health"):
            conn.connect()  # redis-py before 6: what its send calls too
        else:
            conn.connect_check_health(check_health=False)
        sock = conn._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT_ON_CLOSE)

    def read(self) -> Any:
        """The next reply; an error reply raised as redis-py's exception
        (read all the same: the connection stays in step)."""
        if self.owed <= 0:
            # a read of a reply nobody sent for would take the next call's
            raise redis.exceptions.InvalidResponse("no reply is owed on this connection")
        if not self.here:
            try:
                reply = self.conn.read_response()
            except redis.ResponseError:
                self.owed -= 1
                raise
            except BaseException:
                self.disconnect()
                raise
            self.owed -= 1
            return reply
        try:
            reply = self._short() if self._pos == len(self._buf) else self._reply()
        except socket.timeout:
            self.disconnect()
            raise redis.TimeoutError(f"Timeout reading from {self._where()}") from None
        except OSError as exc:
            self.disconnect()
            raise redis.ConnectionError(
                f"Error while reading from {self._where()}: {exc}") from None
        except BaseException:
            self.disconnect()  # out of step with the server
            raise
        self.owed -= 1
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def disconnect(self) -> None:
        """Close the connection: the replies still owed on it go with it (it
        reconnects when next used)."""
        self.owed = 0
        self.conn.disconnect()

    def _where(self) -> str:
        kw = self.conn.__dict__
        return str(kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}")

    def _recv(self) -> bytes:
        sock = self.conn._sock
        if sock is None or sock is not self._sock:
            raise redis.ConnectionError("Connection closed before the reply was read")
        data: bytes = sock.recv(READ_SIZE)
        if not data:
            raise redis.ConnectionError("Connection closed by server.")
        return data

    def _more(self) -> None:
        self._buf = self._buf[self._pos:] + self._recv()
        self._pos = 0

    def _short(self) -> Any:
        """The next reply when nothing is buffered (a lock call's, usually): an
        integer or a bulk string that one read brings whole is parsed here in
        one go, anything else as :meth:`_reply` parses it."""
        buf = self._buf = self._recv()
        self._pos = 0
        end = buf.find(_CRLF)
        if end > 0:
            kind = buf[0]
            if kind == 58:  # b":"
                self._pos = end + 2
                return int(buf[1:end])
            if kind == 36:  # b"$"
                size = int(buf[1:end])
                stop = end + 2 + size
                if size >= 0 and len(buf) >= stop + 2:
                    self._pos = stop + 2
                    data = buf[end + 2:stop]
                    return data.decode(self._encoding, self._errors) if self._decode else data
        return self._reply()

    def _line(self) -> bytes:
        end = self._buf.find(_CRLF, self._pos)
        while end < 0:
            self._more()
            end = self._buf.find(_CRLF, self._pos)
        line = self._buf[self._pos:end]
        self._pos = end + 2
        return line

    def _bulk(self, size: int) -> bytes:
        while len(self._buf) < self._pos + size + 2:
            self._more()
        end = self._pos + size
        data = self._buf[self._pos:end]
        self._pos = end + 2
        return data

    def _text(self, data: bytes) -> Any:
        return data.decode(self._encoding, self._errors) if self._decode else data

    def _reply(self) -> Any:
        line = self._line()
        kind = line[:1]
        if kind == b":":
            return int(line[1:])
        if kind == b"$":
            size = int(line[1:])
            return None if size < 0 else self._text(self._bulk(size))
        if kind == b"*" or kind == b"~":  # a set comes back as a list, as from redis-py
            size = int(line[1:])
            return None if size < 0 else [self._reply() for _ in range(size)]
        if kind == b"+":
            return self._text(line[1:])
        if kind == b"-" or kind == b"!":
            text = line[1:] if kind == b"-" else self._bulk(int(line[1:]))
            error = self.conn._parser.parse_error(text.decode("utf-8", errors="replace"))
            if isinstance(error, redis.ConnectionError):
                raise error  # LOADING, too many clients: as redis-py raises them
            return error
        if kind == b"_":
            return None
        if kind == b"(":
            return int(line[1:])
        if kind == b",":
            return float(line[1:])
        if kind == b"#":
            return line[1:] == b"t"
        if kind == b"=":
            return self._text(self._bulk(int(line[1:]))[4:])
        if kind == b"%":
            table = {}
            for _ in range(int(line[1:])):
                key = self._reply()
                table[key] = self._reply()
            return table
        if kind == b">":  # a push message: redis-py's handlers see it, the reply follows
            push = [self._reply() for _ in range(int(line[1:]))]
            handle = getattr(self.conn._parser, "handle_push_response", None)
            if handle is not None:
                handle(push)
            return self._reply()
        raise redis.exceptions.InvalidResponse(f"Protocol Error: {line!r}")
