"""The renewer's watches: connections that never carry a command, readable the
moment their server goes away (a crash, a restart, a kill).

A :class:`RedisWatch` waits on one server; :class:`MastersWatch` on every
Redlock master, :class:`ClusterWatch` on every Cluster primary (following the
slot map). Each reconnects, backing off, until its server answers again, and
then reports a :class:`~.base.Back`: the renewer (:mod:`..worker.heartbeat`)
re-asserts every held lock at once. Each engine says which watch it needs
(:meth:`.base.Engine.watch`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

import redis

from .base import Back
from .cluster import ClusterWire
from .outage import Outage
from .wire import Wire

logger = logging.getLogger("celery_singleton_lock")

#: how soon the watch tries again to reach a Redis that went away (doubling)
RECONNECT_FIRST, RECONNECT_MAX = 0.02, 0.5


class RedisWatch:
    """A connection that only waits: readable means the server closed it.

    On connect it asks ``INFO server`` for the server's run_id (to say in the
    log whether the server restarted); a user not allowed INFO (the minimal
    ACL rule) is asked ``PING`` instead, from then on, so the ACL log gets one
    denial per watch, not one per reconnect."""

    def __init__(self, connect: Callable[[], Any], outage: Optional[Outage] = None) -> None:
        self._connect = connect
        self._outage = outage
        self._info = True
        self._conn: Optional[Any] = None
        self.fd: Optional[int] = None
        self.run_id: Optional[str] = None
        self._retry_at = 0.0
        self._backoff = RECONNECT_FIRST
        self.down = False  # the server went away and has not answered since
        #: the server that answered last is a new one (its run_id changed)
        self.restarted = False
        self.losses = 0

    @property
    def retry_in(self) -> Optional[float]:
        """Seconds until the next reconnect attempt; None while connected."""
        if self._conn is not None:
            return None
        return max(self._retry_at - time.monotonic(), 0.0)

    def fileno(self) -> tuple[Optional[int], bool]:
        """The socket to wait on (connecting first if due), and whether the
        server just came back after going away (True once per loss)."""
        if self._conn is not None:
            return self._conn._sock.fileno(), False
        if time.monotonic() < self._retry_at:
            return None, False
        try:
            conn = self._connect()
        except redis.RedisError:  # a Cluster whose slot map cannot be read now
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_MAX)
            return None, False
        try:
            conn.connect()
            info = self._hello(conn)
        except redis.RedisError:
            conn.disconnect()
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_MAX)
            return None, False
        self._conn = conn
        self._backoff = RECONNECT_FIRST
        previous, self.run_id = self.run_id, _run_id(info) if info is not None else None
        self.restarted = None not in (previous, self.run_id) and self.run_id != previous
        came_back, self.down = self.down, False
        self.fd = conn._sock.fileno()
        return self.fd, came_back

    def _hello(self, conn: Any) -> Any:
        """The first command on a new connection: its run_id, or None."""
        if self._info:
            conn.send_command("INFO", "server", check_health=False)
            try:
                return conn.read_response()
            except redis.exceptions.NoPermissionError:
                self._info = False  # the minimal ACL rule: PING is granted
        conn.send_command("PING", check_health=False)
        conn.read_response()
        return None

    def poll(self) -> tuple[list[int], list[Back]]:
        """The sockets to wait on, and the servers that came back since."""
        fd, came_back = self.fileno()
        return ([] if fd is None else [fd]), (
            [Back(self.restarted, self._outage)] if came_back else [])

    def gone(self, fd: Optional[int] = None) -> bool:
        """The socket turned readable: true when the server closed it (or sent
        what an idle connection never gets); then start over. ``fd``: which of
        the sockets :meth:`poll` gave (one here)."""
        if self._conn is not None:
            try:
                if not self._conn.can_read(timeout=0):
                    return False  # transport bytes only (a TLS session ticket)
            except (redis.RedisError, OSError):
                pass
            self._conn.disconnect()
            self._conn = None
            self.fd = None
        self.down = True
        self.losses += 1
        self._retry_at = 0.0
        return True

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
            self.fd = None


class MultiWatch:
    """One :class:`RedisWatch` per server of a deployment made of several."""

    def __init__(self) -> None:
        self.watches: dict[str, RedisWatch] = {}

    @property
    def retry_in(self) -> Optional[float]:
        waits = [w.retry_in for w in self.watches.values() if w.retry_in is not None]
        return min(waits) if waits else None

    def poll(self) -> tuple[list[int], list[Back]]:
        fds: list[int] = []
        back: list[Back] = []
        for watch in list(self.watches.values()):
            f, b = watch.poll()
            fds.extend(f)
            back.extend(b)
        return fds, back

    def gone(self, fd: Optional[int] = None) -> bool:
        for watch in list(self.watches.values()):
            if watch.fd is not None and watch.fd == fd:
                return watch.gone()
        return False

    def close(self) -> None:
        for watch in self.watches.values():
            watch.close()


class MastersWatch(MultiWatch):
    """Redlock: every master watched. A master that comes back after going
    away starts a round at once, which writes the held locks back on it if it
    lost them (:meth:`Heartbeat.renew_now`)."""

    def __init__(self, masters: Sequence[tuple[str, Wire]]) -> None:
        super().__init__()
        for name, wire in masters:
            self.watches[name] = RedisWatch(wire.new_connection, wire.outage)


class ClusterWatch(MultiWatch):
    """One :class:`RedisWatch` per primary of a Cluster, following the slot
    map: a primary that restarts (or is killed) is noticed at once."""

    def __init__(self, wire: ClusterWire) -> None:
        super().__init__()
        self.wire = wire
        self._map_seen = -1

    def _follow_map(self) -> None:
        if self.watches and self.wire.map_version == self._map_seen:
            return
        try:
            served = self.wire.slots_by_primary()
        except redis.RedisError:  # no node answers now: keep what is watched
            return
        self._map_seen = self.wire.map_version
        for name in list(self.watches):
            if name not in served:  # failed over, or its slots moved away
                self.watches.pop(name).close()
        for name, (wire, _slots) in served.items():
            if name not in self.watches:
                self.watches[name] = RedisWatch(wire.new_connection, wire.outage)

    def poll(self) -> tuple[list[int], list[Back]]:
        self._follow_map()
        return super().poll()


def _run_id(info: Any) -> Optional[str]:
    if isinstance(info, dict):
        value = info.get("run_id")
        return str(value) if value is not None else None
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line.split(":", 1)[1].strip()
    return None


#: what the renewer waits on: one server's watch, or one per server
