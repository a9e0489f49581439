"""Who holds a key, and whether that process still lives.

A lock's owner record names the process that took it: a host key (boot id,
pid namespace and the process's start time), a pid and an execution id. This
module makes those values, answers "is that process provably gone?", and
keeps the process's own state right across ``fork``: a prefork pool forks
children from a main process whose threads (the reaper, a revoke watcher) may
be inside one of our critical sections at that very moment, so no mutex of
ours is inherited held; nor is a log stream's, which one of those threads may
be writing a line to (see :func:`_hold_log_writes`).

A pid alone is not a process: once a holder dies its pid may be given to a
new process (the pid counter wraps, at 32768 on many hosts). The start time
(``/proc/<pid>/stat``, clock ticks since boot) tells the two apart, so a
reused pid reads as dead, not as the holder still running.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, ClassVar, Mapping, Optional

_after_fork: list[Callable[[], None]] = []


def at_fork_in_child(func: Callable[[], None]) -> Callable[[], None]:
    """Run ``func`` in every child this process forks (before any other code of ours)."""
    _after_fork.append(func)
    return func


def _run_after_fork() -> None:
    for func in _after_fork:
        func()


#: the longest a fork waits for the log lines being written to be written
LOG_WRITE_WAIT = 5.0
_held_for_fork: list[Any] = []


def _hold_log_writes() -> None:
    """Before a fork: wait for every log line being written to be written.

    A log handler writes under its own lock, and its stream (a buffered file,
    stderr) under another. ``logging`` gives the child fresh handler locks,
    but a stream's lock held by a thread of the parent at the fork (one of our
    threads logging "released the lock of a dead child" while the pool forks
    that child's replacement) is inherited held, by a thread the child does
    not have: the child's first log line blocks for ever, and the pool slot
    with it. So the forking thread takes every handler's lock first, which
    waits out the lines in flight, and gives them back once forked.

    ``logging``'s own lock is taken before them, as a configuration change
    takes it before the handlers' (so a thread reconfiguring logging and a
    fork cannot wait for each other), and no lock is waited for longer than
    :data:`LOG_WRITE_WAIT` in all (a handler that chains to another takes the
    two in its own order): one not had by then is left as ``logging`` leaves it.
    """
    deadline = time.monotonic() + LOG_WRITE_WAIT
    config = getattr(logging, "_lock", None)  # logging's module lock (3.9 to 3.13)
    if config is None or not config.acquire(timeout=LOG_WRITE_WAIT):
        return
    _held_for_fork.append(config)
    manager = logging.Logger.manager
    loggers = [logging.getLogger()] + [
        lg for lg in list(manager.loggerDict.values()) if isinstance(lg, logging.Logger)]
    seen: set[int] = set()
    for lg in loggers:
        for handler in list(lg.handlers):
            lock = getattr(handler, "lock", None)
            if lock is None or id(lock) in seen:
                continue
            seen.add(id(lock))
            try:
                taken = lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            except TypeError:  # a handler's own kind of lock: left as logging leaves it
                continue
            if taken:
                _held_for_fork.append(lock)


def _give_back_log_locks() -> None:
    """After a fork, in either process: the locks :func:`_hold_log_writes`
    took. In the child ``logging`` has made most of them new already (then
    there is nothing to give back)."""
    while _held_for_fork:
        lock = _held_for_fork.pop()
        with contextlib.suppress(RuntimeError):  # made new in the child: not held
            lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_run_after_fork)
    os.register_at_fork(before=_hold_log_writes, after_in_parent=_give_back_log_locks,
                        after_in_child=_give_back_log_locks)


class ForkSafeLock:
    """A mutex that a forked child always gets free.

    ``os.fork`` copies a held ``threading.Lock`` as held, and the thread that
    would release it does not exist in the child: the child's first ``with``
    blocks for ever. Every mutex of the library is one of these, replaced by a
    fresh one in the child (which runs one thread at that point).
    """

    __slots__ = ("__weakref__", "lock")

    _all: ClassVar[weakref.WeakSet[ForkSafeLock]] = weakref.WeakSet()

    def __init__(self) -> None:
        #: the current ``threading.Lock`` (a fresh one in a forked child): on a
        #: path run for every task, ``with mutex.lock:`` calls no Python method
        self.lock = threading.Lock()
        ForkSafeLock._all.add(self)

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()

    @classmethod
    def _renew_all(cls) -> None:
        for lock in list(cls._all):
            lock.lock = threading.Lock()


at_fork_in_child(ForkSafeLock._renew_all)


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


def start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot: field 22 of
    ``/proc/<pid>/stat``), or '' when it cannot be read (no such process, no
    /proc). Read with bare system calls: this runs for every duplicate."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return ""
    try:
        stat = os.read(fd, 1024)
    except OSError:
        return ""
    finally:
        os.close(fd)
    # "pid (comm) state ppid ...": the fields after the command's last ")"
    fields = stat.rpartition(b")")[2].split()
    return fields[19].decode() if len(fields) > 19 else ""


def split_host_key(host_key: str) -> tuple[str, str]:
    """(the host part, the process's start time or '') of an owner record's
    ``hostkey``: ``<boot id>:<pid namespace>[:<start ticks>]`` (a record
    written before the start time was kept has none)."""
    head, sep, start = host_key.rpartition(":")
    if sep and head.count(":") == 1 and start.isdigit():
        return head, start
    return host_key, ""


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
        started = start_ticks(self.pid)
        #: the ``hostkey`` of this process's owner records: the host's, and
        #: when this process started (so a reused pid is not taken for it)
        self.host_key = f"{HOST_KEY}:{started}" if started else HOST_KEY

    def new_exec_id(self) -> str:
        """An id no other execution attempt anywhere has."""
        return f"{self.prefix}{next(self.counter):x}"


PROCESS = _Process()
at_fork_in_child(PROCESS.reset)


def pid_alive(pid: int, started: str = "") -> bool:
    """True unless ``pid`` is surely gone (a zombie counts as gone; with
    ``started``, a process of that pid that started at another time too: the
    pid was given to a new process)."""
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
    rest = stat.rpartition(b")")[2]
    if rest[1:2] in (b"Z", b"X"):
        return False
    if started:
        fields = rest.split()
        if len(fields) > 19 and fields[19].decode() != started:
            return False  # another process has its pid now
    return True


#: seconds a holder process seen alive is taken to be alive without asking the
#: kernel again: a storm of duplicates of one running task costs one check per
#: this interval instead of four system calls per duplicate, and a holder that
#: died is noticed at most this late (its lease, seconds long, is the backstop)
ALIVE_RECHECK = 0.25
_seen_alive: dict[tuple[int, str], float] = {}
at_fork_in_child(_seen_alive.clear)


def forget_seen(pid: int) -> None:
    """``pid`` was just seen gone: no remembered "alive" answer for it."""
    for seen_as in [k for k in _seen_alive if k[0] == pid]:
        _seen_alive.pop(seen_as, None)


@dataclass(frozen=True)
class Holder:
    """The execution that has a key, as its owner record names it."""

    task_id: str
    exec_id: str = ""
    host_key: str = ""
    pid: int = 0
    hostname: str = ""

    @classmethod
    def of(cls, record: Mapping[str, str]) -> Holder:
        """The holder an owner record names (:func:`.engine.replies.record`)."""
        return cls(task_id=record.get("task", ""), exec_id=record.get("exec", ""),
                   host_key=record.get("hostkey", ""), pid=int(record.get("pid") or 0),
                   hostname=record.get("host", ""))

    @property
    def on_this_host(self) -> bool:
        """Its process ran on this host, in our pid namespace."""
        return split_host_key(self.host_key)[0] == HOST_KEY

    def provably_dead(self) -> bool:
        """Its process ran in our pid namespace and no longer exists (its pid
        is free, or another process that started later has it)."""
        host, started = split_host_key(self.host_key)
        if host != HOST_KEY or self.pid <= 0:
            return False
        now = time.monotonic()
        seen_as = (self.pid, started)
        seen = _seen_alive.get(seen_as)
        if seen is not None and now - seen < ALIVE_RECHECK:
            return False
        if pid_alive(self.pid, started):
            if len(_seen_alive) >= 4096:
                _seen_alive.clear()
            _seen_alive[seen_as] = now
            return False
        _seen_alive.pop(seen_as, None)
        return True
