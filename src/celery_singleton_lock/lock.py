"""The lock engine: acquire, release, renew and hand off over redis-py.

Every Redis call of the library goes through :class:`LockEngine`. The Lua
scripts in ``lua/`` do compare-then-act on the execution id, so nobody frees or
extends a lock that is no longer theirs; each is registered once and called by
SHA (one round trip).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Optional, Sequence

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from .config import SingletonConfig
from .exceptions import LockLostError
from .keys import LockKeys

logger = logging.getLogger("celery_singleton_lock")

ACQUIRED, HELD, SAME_TASK, FINISHED, DONE = 1, 0, 2, 3, 4
#: what a release found: freed it, another execution's record, no record at all
RELEASED, TAKEN, FREE = 1, 0, -1
FENCE_TTL_MS = 24 * 3600 * 1000


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _host_key() -> str:
    """Identifies the pid namespace of this process: same key, same meaning of a pid."""
    boot = _read("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "0"
    return f"{boot}:{ns}"


HOST_KEY = _host_key()


class _Process:
    """What identifies this process, kept current across fork without a system
    call per task: the pid, a fork generation, and a random prefix that makes
    execution ids unique across processes (a counter makes them unique within)."""

    def __init__(self) -> None:
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        self.pid = os.getpid()
        self.generation += 1
        self.prefix = uuid.uuid4().hex[:16]
        self.counter = itertools.count(1)


PROCESS = _Process()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PROCESS.reset)


def pid_alive(pid: int) -> bool:
    """True unless ``pid`` is surely gone (a zombie counts as gone)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone too: "pid (comm) S ...", the state follows the last
    # parenthesis. Read with bare system calls: this runs for every duplicate.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return True
    try:
        stat = os.read(fd, 512)
    except OSError:
        return True
    finally:
        os.close(fd)
    state = stat.rpartition(b")")[2][1:2]
    return state not in (b"Z", b"X")


#: seconds a holder process seen alive is taken to be alive without asking the
#: kernel again: a storm of duplicates of one running task costs one check per
#: this interval instead of four system calls per duplicate, and a holder that
#: died is noticed at most this late (its lease, seconds long, is the backstop)
ALIVE_RECHECK = 0.25
_seen_alive: dict[int, float] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_seen_alive.clear)


@dataclass(frozen=True)
class Holder:
    task_id: str
    exec_id: str
    host_key: str
    pid: int
    hostname: str

    def provably_dead(self) -> bool:
        """Its process ran in our pid namespace and no longer exists."""
        if self.host_key != HOST_KEY or self.pid <= 0:
            return False
        now = time.monotonic()
        seen = _seen_alive.get(self.pid)
        if seen is not None and now - seen < ALIVE_RECHECK:
            return False
        if pid_alive(self.pid):
            if len(_seen_alive) >= 4096:
                _seen_alive.clear()
            _seen_alive[self.pid] = now
            return False
        _seen_alive.pop(self.pid, None)
        return True


@dataclass(frozen=True)
class Outcome:
    status: int
    token: int = 0
    holder: Optional[Holder] = None


class SingletonLock:
    """What a running task sees as ``self.singleton``.

    ``key``     the lock's key (a hash: no argument value in it)
    ``token``   fencing token, increasing with every grant of this key (0: no lock)
    ``lost``    true once the lock is known or presumed no longer ours
    ``check()`` raises :class:`LockLostError` when ``lost``
    """

    __slots__ = (
        "_deadline",
        "_lost_reason",
        "exec_id",
        "handed_off",
        "held",
        "key",
        "keys",
        "lease",
        "task_id",
        "task_name",
        "token",
    )

    def __init__(
        self,
        keys: LockKeys,
        *,
        task_id: str = "",
        task_name: str = "",
        exec_id: str = "",
        token: int = 0,
        lease: float = 0.0,
        started: float = 0.0,
        held: bool = False,
    ) -> None:
        self.keys = keys
        self.key = keys.base
        self.task_id = task_id
        self.task_name = task_name
        self.exec_id = exec_id
        self.token = token
        self.lease = lease
        self.held = held
        self.handed_off = False
        # The lease counts from before the request left: a conservative deadline.
        self._deadline = started + lease if held else float("inf")
        self._lost_reason: Optional[str] = None

    @property
    def lost(self) -> bool:
        if self._lost_reason is not None:
            return True
        if self.held and time.monotonic() > self._deadline:
            self.mark_lost("lease ran out before it could be renewed")
            return True
        return False

    def check(self) -> None:
        """Raise :class:`LockLostError` if this execution may no longer hold the lock."""
        if self.lost:
            raise LockLostError(self.key, self.token, self._lost_reason or "lost")

    def renewed(self, sent_at: float) -> None:
        if self._lost_reason is None:
            self._deadline = sent_at + self.lease

    def mark_lost(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
            logger.warning(
                "Lost singleton lock %s (token %s) of %s[%s]: %s",
                self.key, self.token, self.task_name, self.task_id, reason,
            )

    def __repr__(self) -> str:
        state = "lost" if self._lost_reason else ("held" if self.held else "unlocked")
        return f"<SingletonLock {self.key} token={self.token} {state}>"


def _script(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def _pack(parts: Sequence[Any]) -> bytes:
    """One RESP command; our arguments are only str and int."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else b"%d" % part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


@dataclass(frozen=True)
class ReleaseReply:
    """What a release sent without waiting found, read later.

    ``status``   RELEASED, TAKEN (another execution holds the key) or FREE (no
                 owner: the lease ran out, or the first attempt freed it)
    ``repeated`` the command was sent again after its reply was lost with the
                 connection, so FREE most likely means the first attempt worked
    """

    status: int
    repeated: bool = False


def _evalsha(script: Script, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    return _pack(["EVALSHA", script.sha, len(keys), *keys, *args])


Answered = Callable[[Any, Optional[Exception], bool], None]


class _Pending:
    """A command sent without waiting: what to repeat, whom to tell."""

    __slots__ = ("answered", "args", "keys", "script")

    def __init__(self, script: Script, keys: Sequence[str], args: Sequence[Any],
                 answered: Answered) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.answered = answered

    def answer(self, reply: Any, error: Optional[Exception], repeated: bool = False) -> None:
        try:
            self.answered(reply, error, repeated)
        except Exception:  # a reply read on someone else's call must not break it
            logger.exception("Handling a lock reply failed")


class LockEngine:
    """All Redis work of one process for one app."""

    def __init__(self, client: redis.Redis, config: SingletonConfig) -> None:
        self.heartbeat: Optional[Any] = None  # set by heartbeat.heartbeat_for
        self.client = client
        self.config = config
        self._acquire: Script = client.register_script(_script("acquire"))
        self._release: Script = client.register_script(_script("release"))
        self._renew: Script = client.register_script(_script("renew"))
        self._handoff: Script = client.register_script(_script("handoff"))
        self._enqueue: Script = client.register_script(_script("enqueue"))
        # Connections of the hot path, kept out of the pool: taking one is a
        # list pop, where the pool's checkout costs system calls every time.
        self._idle: list[Any] = []
        # Connections owing the reply of a command sent without waiting.
        self._unsettled: list[tuple[Any, _Pending]] = []
        self._unqueue: Script = client.register_script(_script("unqueue"))

    def _take(self) -> Any:
        """A connection in step: every reply owed on it read first."""
        self.settle()
        try:
            return self._idle.pop()
        except IndexError:
            return self.client.connection_pool.make_connection()

    def _run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self._call(script, keys, args)[0]

    def _call(self, script: Script, keys: Sequence[str],
              args: Sequence[Any]) -> tuple[Any, bool]:
        """EVALSHA ``script`` in one round trip: (reply, whether it was sent twice).

        The hot path writes the command itself on a connection of its own: redis-py's
        generic command layer costs more CPU than the round trip on a fast
        network. A broken connection is retried once on a fresh one (every
        script is safe to repeat: the owner check makes a repeat a no-op or a
        "not ours"); a server that lost its scripts gets them loaded again.
        """
        packed = _evalsha(script, keys, args)
        for attempt in (1, 2):
            conn = self._take()
            try:
                try:
                    conn.send_packed_command([packed], check_health=False)
                    reply = conn.read_response()
                except NoScriptError:
                    self.client.script_load(script.script)
                    conn.send_packed_command([packed], check_health=False)
                    reply = conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError):
                conn.disconnect()
                if attempt == 2:
                    raise
                continue
            except BaseException:
                conn.disconnect()  # an answer may still be on its way: never reuse it
                raise
            self._idle.append(conn)
            return reply, attempt == 2
        raise AssertionError("unreachable")

    def _run_later(self, script: Script, keys: Sequence[str], args: Sequence[Any],
                   answered: Answered) -> None:
        """Send ``script`` now and read its reply later; ``answered(reply, error)``.

        The command leaves at once, so Redis runs it in order before anything
        this process sends afterwards; only the wait for the reply is saved.
        The reply is read by the next call on that connection, by the
        heartbeat's next round or by :meth:`settle`. Nothing is lost when it
        fails: a server that lost its scripts or a broken connection gets the
        command again, waiting this time (every script is safe to repeat).
        """
        pending = _Pending(script, keys, args, answered)
        packed = _evalsha(script, keys, args)
        try:
            conn = self._take()
            try:
                conn.send_packed_command([packed], check_health=False)
            except BaseException:
                conn.disconnect()
                raise
        except (redis.ConnectionError, redis.TimeoutError):
            self._redo(pending, repeated=True)  # some of it may have left
            return
        self._unsettled.append((conn, pending))

    def _settle(self, conn: Any, pending: _Pending) -> None:
        try:
            reply = conn.read_response()
        except NoScriptError:
            self._idle.append(conn)  # in step: the error was the whole reply
            self._redo(pending, repeated=False)  # it never ran; loads the script again
            return
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            self._redo(pending, repeated=True)  # it may have run
            return
        except redis.RedisError as exc:
            self._idle.append(conn)
            pending.answer(None, exc)
            return
        except BaseException:
            conn.disconnect()
            raise
        self._idle.append(conn)
        pending.answer(reply, None)

    def _redo(self, pending: _Pending, repeated: bool) -> None:
        try:
            reply, again = self._call(pending.script, pending.keys, pending.args)
        except redis.RedisError as exc:
            pending.answer(None, exc, repeated)
        else:
            pending.answer(reply, None, repeated or again)

    def settle(self) -> None:
        """Read every reply still owed to this process (see :meth:`release_later`)."""
        unsettled = self._unsettled
        while unsettled:  # every lock call starts here: nothing raised when none is owed
            try:
                conn, pending = unsettled.pop()
            except IndexError:  # the heartbeat thread read the last one
                return
            self._settle(conn, pending)

    @property
    def unsettled(self) -> int:
        """Commands sent whose reply has not been read yet."""
        return len(self._unsettled)

    @classmethod
    def from_config(cls, config: SingletonConfig) -> LockEngine:
        options: dict[str, Any] = {
            "socket_timeout": 5.0,
            "socket_connect_timeout": 5.0,
            "health_check_interval": 30,
        }
        options.update(config.redis_options)
        options["decode_responses"] = True
        return cls(redis.Redis.from_url(config.redis_url, **options), config)

    @staticmethod
    def new_exec_id() -> str:
        """An id no other execution attempt anywhere has."""
        return f"{PROCESS.prefix}{next(PROCESS.counter):x}"

    def acquire(
        self,
        keys: LockKeys,
        *,
        task_id: str,
        exec_id: str,
        lease_ms: int,
        hostname: str,
        retries: int,
        task_name: str,
        scope: str = "run",
        comes_back: bool = False,
    ) -> Outcome:
        """Take the lock for an execution that starts now.

        ``comes_back``: a refused execution will be sent again (policy retry), so
        a key it took at send time stays its own meanwhile.
        """
        reply = self._run(
            self._acquire,
            [keys.lock, keys.fence, keys.fin, keys.queued, keys.done],
            [
                task_id, exec_id, lease_ms, hostname, HOST_KEY, PROCESS.pid,
                retries, task_name, FENCE_TTL_MS, scope, int(comes_back),
            ],
        )
        status = int(reply[0])
        if status == ACQUIRED:
            return Outcome(ACQUIRED, token=int(reply[1]))
        if status == FINISHED:
            return Outcome(FINISHED)
        if status == DONE:
            return Outcome(DONE, holder=Holder(reply[1], "", "", 0, ""))
        holder = Holder(
            task_id=reply[1],
            exec_id=reply[2],
            host_key=reply[3],
            pid=int(reply[4] or 0),
            hostname=reply[5],
        )
        return Outcome(status, holder=holder)

    def release(
        self,
        keys: LockKeys,
        exec_id: str,
        task_id: str,
        *,
        finished: bool = True,
        always_record: bool = False,
        done_ttl: float = 0.0,
    ) -> bool:
        """Free the lock if ``exec_id`` still owns it; True when this call freed it.

        A repeat after a lost reply that finds the key free counts as freed: its
        first attempt did it. ``done_ttl`` > 0: the task succeeded and its key
        stays done that long.
        """
        reply, repeated = self._call(self._release, *self._release_call(
            keys, exec_id, task_id, finished, always_record, done_ttl))
        status = int(reply)
        return status == RELEASED or (status == FREE and repeated)

    def _release_call(self, keys: LockKeys, exec_id: str, task_id: str, finished: bool,
                      always_record: bool, done_ttl: float) -> tuple[list[str], list[Any]]:
        fin_ms = int(self.config.finished_ttl * 1000)
        return (
            [keys.lock, keys.fin, keys.done],
            [exec_id, task_id, int(finished), fin_ms, int(always_record), int(done_ttl * 1000)],
        )

    def release_later(
        self,
        keys: LockKeys,
        exec_id: str,
        task_id: str,
        answered: Callable[[Optional[ReleaseReply], Optional[Exception]], None],
        *,
        always_record: bool = False,
        done_ttl: float = 0.0,
    ) -> None:
        """:meth:`release` without waiting for the reply.

        Redis frees the key as soon as the command arrives, before anything
        this process sends next; ``answered(reply, error)`` is called when the
        reply has been read, with a :class:`ReleaseReply` (``error`` once
        repeating the command failed).
        """
        def done(reply: Any, error: Optional[Exception], repeated: bool) -> None:
            answered(None if error is not None else ReleaseReply(int(reply), repeated), error)

        self._run_later(self._release, *self._release_call(
            keys, exec_id, task_id, True, always_record, done_ttl), done)

    def enqueue(self, keys: LockKeys, task_id: str, scope: str, ttl_ms: int) -> Outcome:
        """Take the key for a task about to be sent; ACQUIRED, HELD or DONE."""
        reply = self._run(
            self._enqueue, [keys.queued, keys.lock, keys.done], [task_id, scope, max(ttl_ms, 1)]
        )
        status = int(reply[0])
        if status == ACQUIRED:
            return Outcome(ACQUIRED)
        return Outcome(status, holder=Holder(reply[1], "", "", 0, ""))

    def unqueue(self, keys: LockKeys, task_id: str) -> bool:
        """Free a key taken at send time, if ``task_id`` still has it."""
        return bool(self._run(self._unqueue, [keys.queued], [task_id]))

    def renew(self, entries: Sequence[tuple[str, str, int]]) -> list[int]:
        """Renew ``(lock key, exec id, lease ms)`` entries in one call."""
        if not entries:
            return []
        args: list[Any] = []
        for _, exec_id, lease_ms in entries:
            args.append(exec_id)
            args.append(lease_ms)
        reply = self._run(self._renew, [e[0] for e in entries], args)
        return [int(x) for x in reply]

    def hand_off(self, keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int) -> bool:
        return bool(self._run(self._handoff, [keys.lock], [exec_id, next_retries, lease_ms]))

    def owner(self, keys: LockKeys) -> dict[str, str]:
        """The owner record, empty when the key is free."""
        return self.client.hgetall(keys.lock)  # type: ignore[return-value]

    def clear_dead_holder(self, keys: LockKeys, holder: Holder) -> bool:
        """Free a lock whose holder process is provably gone from this host."""
        if not holder.provably_dead():
            return False
        released = self.release(keys, holder.exec_id, holder.task_id, finished=False)
        if released:
            logger.warning(
                "Released singleton lock %s of task %s: its process %s has died",
                keys.base, holder.task_id, holder.pid,
            )
        return released

    def reap(self, keys: LockKeys, task_id: str, wait: float = 3.0) -> bool:
        """Free ``task_id``'s lock once its process on this host is gone.

        Called by the main worker process when a child was killed or timed out;
        waits up to ``wait`` seconds for the child to exit.
        """
        record = self.owner(keys)
        if record.get("task") != task_id:
            return False
        holder = Holder(
            task_id=task_id,
            exec_id=record.get("exec", ""),
            host_key=record.get("hostkey", ""),
            pid=int(record.get("pid") or 0),
            hostname=record.get("host", ""),
        )
        if holder.host_key != HOST_KEY:
            return False
        deadline = time.monotonic() + wait
        while pid_alive(holder.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        _seen_alive.pop(holder.pid, None)  # seen gone just now: no remembered answer
        return self.clear_dead_holder(keys, holder)


_engines: weakref.WeakKeyDictionary[Any, tuple[int, LockEngine]] = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def engine_for(app: Any) -> LockEngine:
    """The engine of ``app`` in this process (a new one after fork)."""
    from .config import get_config

    generation = PROCESS.generation
    entry = _engines.get(app)
    if entry is None or entry[0] != generation:
        with _engines_lock:
            entry = _engines.get(app)
            if entry is None or entry[0] != generation:
                entry = (generation, LockEngine.from_config(get_config(app)))
                _engines[app] = entry
    return entry[1]


def settle_all() -> None:
    """Read the replies every engine of this process still owes (at process exit)."""
    generation = PROCESS.generation
    for entry in list(_engines.values()):
        if entry[0] == generation:
            try:
                entry[1].settle()
            except Exception as exc:  # exiting: say so, never raise
                logger.warning("Could not read a lock reply at exit: %r", exc)


atexit.register(settle_all)


def forget_engine(app: Any) -> None:
    with _engines_lock:
        _engines.pop(app, None)
