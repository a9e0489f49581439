"""The one door to the lock Redis: what every deployment's engine does.

:class:`~.server.LockEngine` serves one server, a Sentinel-managed primary and
a Cluster (its wire differs, not its operations); :class:`~.redlock.engine.
RedlockEngine` a majority of independent masters. Both are an :class:`Engine`,
so nothing outside this package asks which kind it has: what differs between
them (which servers there are, how many must agree, what the renewer watches,
how a renewal round is heard) is asked of the engine itself.

The operations that only combine others (freeing a dead holder's lock, or a
killed child's) are written here once, on top of :meth:`Engine.owner` and
:meth:`Engine.release`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

from ..config import REPLACE, SingletonConfig
from ..keys import LockKeys
from ..process import Holder, forget_seen, pid_alive, split_host_key
from .outage import Outage
from .replies import Acquired, Enqueued, Reclaimed, Released, Renew
from .request import Request

logger = logging.getLogger("celery_singleton_lock")

#: ``(lock key, execution id, lease ms)``: one lock of a renewal round
Entry = tuple[str, str, int]


class Back(NamedTuple):
    """A watched server answers again after going away."""

    #: it is a new server (its run_id changed; False also when INFO is not
    #: allowed): said in the log only, the renewal tells forgotten keys itself
    restarted: bool
    #: the outage of the wire that talks to it, if calls fail at once meanwhile
    outage: Optional[Outage] = None


class Watch(Protocol):
    """What the renewer watches (:meth:`Engine.watch`; :mod:`.watch` has them):
    connections that never carry a command, readable the moment their server
    goes away, that report each server that answers again."""

    @property
    def retry_in(self) -> Optional[float]:
        """Seconds until a server that went away is tried again (None: none is away)."""

    def poll(self) -> tuple[list[int], list[Back]]:
        """The sockets to wait on, and the servers that answer again since."""

    def gone(self, fd: Optional[int] = None) -> bool:
        """The server behind ``fd`` (readable) went away."""

    def close(self) -> None:
        """Close every connection of the watch."""


#: the settings a native call cannot serve, each with what makes it need a script
NEEDS_A_SCRIPT = (
    ("singleton_scope", lambda c: c.scope != "run"),
    ("singleton_limit", lambda c: c.limit > 1),
    ("singleton_throttle", lambda c: c.throttle > 0),
    ("singleton_on_duplicate", lambda c: c.on_duplicate == REPLACE),
    ("singleton_wait_replicas", lambda c: c.wait_replicas > 0),
    ("singleton_also_lock", lambda c: c.also_lock is not None),
)


def needs_a_script(config: SingletonConfig) -> list[str]:
    """The settings of ``config`` (a task's) that only a script serves."""
    return [name for name, needs in NEEDS_A_SCRIPT if needs(config)]


def native_serves(config: SingletonConfig) -> bool:
    return not needs_a_script(config)


class Engine(ABC):
    """All Redis work of one process for one app."""

    #: the checked settings of the app the engine serves
    config: SingletonConfig
    #: where stats, held-lock listings and beat's tick claims live (with
    #: Redlock, the first master)
    client: Any

    # -- what differs between deployments ---------------------------------------------

    @property
    def quorum(self) -> int:
        """How many of :meth:`servers` must agree for a lock to be held."""
        return 1

    @abstractmethod
    def servers(self) -> list[tuple[str, Any]]:
        """Every Redis the locks live on, each with a name to show: one, or the
        masters of Redlock."""

    @abstractmethod
    def watch(self) -> Watch:
        """What the renewer watches, so it learns at once that a server went
        away and when it is back."""

    @property
    @abstractmethod
    def down(self) -> bool:
        """An outage is known: lock calls fail at once until it answers again."""

    def lock_path(self) -> tuple[str, bool]:
        """How this engine's lock calls go, for the doctor (``"scripts"``, or
        the native commands and for which tasks), and whether the server runs
        our scripts; may ask the server (a Redis error when it does not answer)."""
        return "scripts", True

    def unserved(self, config: SingletonConfig) -> list[str]:
        """The settings of a task's ``config`` this engine cannot serve, named
        at start: where the server runs no script (:meth:`lock_path`), those
        only a script carries out."""
        return [] if self.lock_path()[1] else needs_a_script(config)

    def clock_offset(self, ask: bool = False) -> Optional[float]:
        """How far the lock Redis's clock is ahead of this host's (seconds;
        negative: behind), from this process's estimate (:mod:`.clock`), or
        None before anything was heard; ``ask``: connect to hear it first.
        Celery times a message's ETA by the clock of whoever reads it: a
        wait measured on the lock Redis's clock is the same everywhere."""
        return None

    def lease_margin(self, lease: float) -> float:
        """Seconds the holder counts its lease short by: none on one server (its
        deadline already counts from before the request left)."""
        return 0.0

    def renew_round(self, entries: Sequence[Entry], *, every: bool = False
                    ) -> tuple[list[Renew], list[list[int]]]:
        """:meth:`renew`, and per lock the servers that no longer have it while
        enough others renewed it (so :meth:`refill` writes it back there);
        ``every``: hear every server, as after one came back. One server
        never has such a gap."""
        return self.renew(entries), [[] for _ in entries]

    def refill(self, keys: LockKeys, request: Request, token: int, *,
               only: Sequence[int], still_held: Callable[[], bool]) -> None:
        """Write a lock held by enough servers back on those at ``only``, which
        lost it. Nothing to do where there is one server."""
        return None

    # -- the lock's operations ----------------------------------------------------------

    @abstractmethod
    def acquire(self, keys: LockKeys, request: Request) -> Acquired:
        """Take the lock for an execution that starts now, on the request's terms."""

    @abstractmethod
    def release(self, keys: LockKeys, exec_id: str, task_id: str, *, finished: bool = True,
                always_record: bool = False, done_ms: int = 0, task_name: str = ""
                ) -> bool:
        """Free the lock if ``exec_id`` still owns it; True when this call freed it."""

    @abstractmethod
    def release_later(self, keys: LockKeys, exec_id: str, task_id: str,
                      answered: Callable[[Optional[Released], Optional[Exception]], None], *,
                      always_record: bool = False, done_ms: int = 0, task_name: str = "",
                      finished: bool = True) -> None:
        """:meth:`release` without waiting for the reply (``answered`` gets it)."""

    @abstractmethod
    def renew(self, entries: Sequence[Entry]) -> list[Renew]:
        """Renew every lock of ``entries`` in one round."""

    @abstractmethod
    def reclaim(self, keys: LockKeys, request: Request, token: int) -> Reclaimed:
        """Write back a lock the server forgot (not one released or taken since)."""

    @abstractmethod
    def raise_fence(self, keys: LockKeys, exec_id: str, token: int) -> bool:
        """Raise the key's fencing counter to at least ``token`` while ``exec_id`` holds it."""

    @abstractmethod
    def hand_off(self, keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int) -> bool:
        """Keep the lock for the retry of the execution that holds it."""

    @abstractmethod
    def owner(self, keys: LockKeys) -> dict[str, str]:
        """The owner record, empty when the key is free."""

    # -- the keys beside the lock -------------------------------------------------------

    @abstractmethod
    def enqueue(self, keys: LockKeys, task_id: str, scope: str, ttl_ms: int,
                task_name: str = "", replace: Optional[tuple[int, int]] = None,
                done: bool = True) -> Enqueued:
        """Take the key for a task about to be sent (the queue scopes)."""

    @abstractmethod
    def unqueue(self, keys: LockKeys, task_id: str) -> bool:
        """Free a key taken at send time, if ``task_id`` still has it."""

    @abstractmethod
    def queued_by(self, keys: LockKeys) -> str:
        """The id of the task that took the key when it was sent, or ''."""

    @abstractmethod
    def claim(self, key: str, value: str, ttl_ms: int) -> tuple[bool, str]:
        """``SET key value NX PX ttl_ms``: (won, the value now there)."""

    @abstractmethod
    def unclaim(self, key: str, value: str) -> bool:
        """Delete a :meth:`claim` if ``value`` still has it."""

    # -- the keys beside the locks: beat's ticks, tick-run markers, the stats ---------
    # Plain values and hashes, each call one command on one server; on
    # Redlock a majority's (written on every master, read as most of them say).

    @abstractmethod
    def read(self, key: str) -> Optional[str]:
        """The value of ``key``, or None."""

    @abstractmethod
    def write(self, key: str, value: str, ttl_ms: int, *, previous: bool = False
              ) -> Optional[str]:
        """Set ``key`` to ``value`` for ``ttl_ms``; ``previous``: return what it held."""

    @abstractmethod
    def take(self, key: str) -> Optional[str]:
        """The value of ``key``, deleted."""

    @abstractmethod
    def present(self, key: str) -> bool:
        """Whether ``key`` exists."""

    @abstractmethod
    def run_script(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One of the library's scripts (beat's, :mod:`..beat.overlap`) on ``keys``."""

    @abstractmethod
    def read_hash(self, key: str) -> dict[str, str]:
        """Every field of the hash ``key``."""

    @abstractmethod
    def update_hash(self, key: str, *, add: Optional[dict[str, float]] = None,
                    put: Optional[dict[str, str]] = None, drop: Sequence[str] = (),
                    ttl_s: int = 0) -> None:
        """Add to, set and delete fields of the hash ``key`` in one round trip,
        and keep it ``ttl_s`` (0: as it is)."""

    # -- replies owed -----------------------------------------------------------------

    @abstractmethod
    def settle(self) -> None:
        """Read every reply still owed to this process."""

    @property
    @abstractmethod
    def unsettled(self) -> int:
        """How many replies this process still owes itself a read of."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection of the engine."""

    # -- a holder that is gone ----------------------------------------------------------

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

    def clear_dead_slots(self, keys: LockKeys, slots: int) -> bool:
        """``singleton_limit``: free the slots 2 to ``slots`` whose holder process
        is provably gone from this host (slot 1's holder comes with a refusal);
        True when one was freed. Read only when every slot is taken."""
        cleared = False
        for slot in keys.slots(slots)[1:]:
            record = self.owner(slot)
            if record and self.clear_dead_holder(slot, Holder.of(record)):
                cleared = True
        return cleared

    def reap(self, keys: LockKeys, task_id: str, wait: float = 3.0, slots: int = 1) -> bool:
        """Free ``task_id``'s lock (in whichever of ``slots`` it holds) once its
        process on this host is gone.

        Called by the main worker process when a child was killed or timed out;
        waits up to ``wait`` seconds for the child to exit.
        """
        for slot in keys.slots(slots):
            record = self.owner(slot)
            if record.get("task") == task_id:
                keys = slot
                break
        else:
            return False
        holder = Holder.of(record)
        if not holder.on_this_host:
            return False
        deadline = time.monotonic() + wait
        while pid_alive(holder.pid, split_host_key(holder.host_key)[1]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        forget_seen(holder.pid)  # seen gone just now: no remembered answer
        return self.clear_dead_holder(keys, holder)
