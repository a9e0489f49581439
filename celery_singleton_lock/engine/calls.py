"""What each script of ``lua/`` is given: its KEYS and ARGV, built from a lock's keys.

The scripts are read once, at import: making an engine later touches no import
machinery, whose per-module locks a forked child could inherit held. The owner
record's layout is in docs/redis-keys.md.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..keys import LockKeys
from ..process import PROCESS
from .request import Request
from .scripts import Script

#: the share of the lease a host's clock may be off the Redis clock before the
#: start-up checks warn (checks/server.py): a key's fencing counter outlives
#: its lock by at least that much, whatever singleton_fence_ttl says
CLOCK_FRACTION = 0.1

#: every script, read once at import (the main worker process makes engines
#: in its reaper thread while the pool forks)
SCRIPTS: dict[str, Script] = {
    name: Script.load(name)
    for name in ("acquire", "acquire_slots", "release", "renew", "handoff", "enqueue", "unqueue",
                 "fence", "reclaim")
}


def fence_ttl_ms(lease_ms: int, keep_ms: int) -> int:
    """How long a key's fencing counter lives from a grant or a renewal: the
    lease, and ``keep_ms`` (``singleton_fence_ttl``) but at least a tenth of the
    lease (docs/fencing.md#retention; renew.lua counts the same)."""
    return lease_ms + max(keep_ms, int(lease_ms * CLOCK_FRACTION))


def _field(value: str) -> str:
    """A record field of ours written by users (host name, task name): no newline."""
    return value.replace("\n", " ") if "\n" in value else value


def record_rest(request: Request, fin_ms: int) -> str:
    """The owner record's fields from ``lease`` on, as one string (docs/redis-keys.md)."""
    return (f"{request.lease.ms}\n{fin_ms}\n{request.retries}\n{PROCESS.pid}\n"
            f"{PROCESS.host_key}\n{_field(request.hostname)}\n"
            f"{_field(request.task_name)}\n{request.task_id}")


def acquire_call(keys: LockKeys, request: Request, fin_ms: int, *, keep_ms: int,
                 deadline_ms: int = 0, confirm_by_ms: int = 0) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``acquire.lua``; ``keep_ms``: how long the key's
    fencing counter outlives the lock (``singleton_fence_ttl``), passed as the
    counter's TTL from the grant, the lease and that; ``deadline_ms``: the
    server clock past which the request does nothing (:mod:`.clock`);
    ``confirm_by_ms``, last: when a grant its holder has not confirmed by then
    expires (0: it lives its lease).

    Redis pays for every string passed (about as much as for a command run
    inside the script), so the owner record's fields that the script does not
    look at go as one string, in the record's own order, the send-time
    marker's key only under the queue scopes, the throttle window's only
    with ``singleton_throttle``, the superseded ids' hash with ``replace``;
    under scope ``run``, the done marker's key only when the task keeps a done
    window (``done``: nothing else writes one for its keys, which hold its name);
    on the other paths the lock's own key takes the done marker's place then.
    ``rate``: (starts, window ms) of ``singleton_rate``; every key is passed
    then, the lock's own key for "not replacing".
    """
    task_id, exec_id, lease_ms, scope = (request.task_id, request.exec_id, request.lease.ms,
                                         request.scope)
    throttle_ms, replace, done, rate = (request.throttle_ms, request.replace, request.done,
                                        request.rate)
    task_name = request.task_name
    rest = record_rest(request, fin_ms)
    fence_ms = fence_ttl_ms(lease_ms, keep_ms)
    # where KEYS go by position, the lock's own key stands for "no done marker"
    done_key = keys.done if done else keys.lock
    if rate[0] > 0:
        return ([keys.lock, keys.fence, keys.fin, done_key, keys.queued, keys.throttle,
                 keys.replaced if replace else keys.lock, keys.rate],
                [task_id, exec_id, lease_ms, rest, scope, throttle_ms, _field(task_name),
                 rate[0], rate[1], fence_ms, deadline_ms, confirm_by_ms])
    if replace:
        return ([keys.lock, keys.fence, keys.fin, done_key, keys.queued, keys.throttle,
                 keys.replaced],
                [task_id, exec_id, lease_ms, rest, scope, throttle_ms, _field(task_name),
                 fence_ms, deadline_ms, confirm_by_ms])
    if throttle_ms > 0:
        return ([keys.lock, keys.fence, keys.fin, done_key, keys.queued, keys.throttle],
                [task_id, exec_id, lease_ms, rest, scope, throttle_ms, _field(task_name),
                 fence_ms, deadline_ms, confirm_by_ms])
    if scope == "run":
        return ([keys.lock, keys.fence, keys.fin, keys.done] if done else
                [keys.lock, keys.fence, keys.fin]), [task_id, exec_id, lease_ms, rest, fence_ms,
                                                     deadline_ms, confirm_by_ms]
    return ([keys.lock, keys.fence, keys.fin, done_key, keys.queued],
            [task_id, exec_id, lease_ms, rest, scope, fence_ms, deadline_ms, confirm_by_ms])


def acquire_slots_call(keys: LockKeys, request: Request, fin_ms: int, *, keep_ms: int,
                       deadline_ms: int = 0, confirm_by_ms: int = 0
                       ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``acquire_slots.lua`` (``singleton_limit`` = the
    request's ``slots`` > 1); without a done window the fence's key stands for
    the marker's; ``rate``, its key last; ``deadline_ms``, ``confirm_by_ms``: as
    :func:`acquire_call`'s."""
    lease_ms, rate = request.lease.ms, request.rate
    keys_ = [keys.fence, keys.fin, keys.done if request.done else keys.fence, keys.back,
             *(k.lock for k in keys.slots(request.slots))]
    args: list[Any] = [request.task_id, request.exec_id, lease_ms, record_rest(request, fin_ms),
                       fence_ttl_ms(lease_ms, keep_ms), deadline_ms, confirm_by_ms]
    if rate[0] > 0:
        return [*keys_, keys.rate], [*args, rate[0], rate[1]]
    return keys_, args


def release_call(keys: LockKeys, exec_id: str, task_id: str, finished: bool,
                 always_record: bool, done_ms: int, fin_ms: int, task_name: str = ""
                 ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``release.lua``: the usual release (a finished task, no
    done window) passes two keys and the execution id; the finish marker's
    task id and TTL come from the owner record."""
    mode = release_mode(finished, always_record)
    if done_ms > 0:
        return [keys.lock, keys.fin, keys.done], [exec_id, mode, task_id, fin_ms, done_ms,
                                                 _field(task_name)]
    if mode == 2:
        return [keys.lock, keys.fin], [exec_id, mode, task_id, fin_ms]
    if mode == 1:
        return [keys.lock, keys.fin], [exec_id]
    return [keys.lock, keys.fin], [exec_id, mode]


def release_mode(finished: bool, always_record: bool) -> int:
    """release.lua's mode: 1 finished, 2 finished and recorded always, 0 not finished."""
    return 0 if not finished else 2 if always_record else 1


def enqueue_call(keys: LockKeys, task_id: str, scope: str, ttl_ms: int, task_name: str = "",
                 replace: Optional[tuple[int, int]] = None, done: bool = True,
                 deadline_ms: int = 0) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``enqueue.lua``; ``replace``: (debounce ms, debounce_max
    ms) of ``singleton_on_duplicate="replace"``; ``done`` False: the task keeps
    no done window, the lock's key stands for the marker's; ``deadline_ms``,
    last: as :func:`acquire_call`'s."""
    done_key = keys.done if done else keys.lock
    if replace is not None:
        return [keys.queued, keys.lock, done_key, keys.replaced], [
            task_id, scope, max(ttl_ms, 1), _field(task_name), *replace, deadline_ms]
    return [keys.queued, keys.lock, done_key], [task_id, scope, max(ttl_ms, 1),
                                               _field(task_name), deadline_ms]


def marker_task(value: Any) -> tuple[str, str]:
    """(task name, task id) of a send-time or done marker's value."""
    text = str(value or "")
    name, newline, task_id = text.partition("\n")
    return (name, task_id) if newline else ("", text)


def unqueue_call(keys: LockKeys, task_id: str) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``unqueue.lua``."""
    return [keys.queued], [task_id]


def renew_call(entries: Sequence[tuple[str, str, int]], keep_ms: int
               ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``renew.lua`` for ``(lock key, exec id, lease ms)``
    entries: each lock with its key's fencing counter, which outlives it by
    ``keep_ms``."""
    names: list[str] = []
    args: list[Any] = [keep_ms]
    for lock, exec_id, lease_ms in entries:
        names.append(lock)
        names.append(fence_of(lock))
        args.append(exec_id)
        args.append(lease_ms)
    return names, args


def fence_of(lock: str) -> str:
    """The fencing counter's key of a lock key (of any slot: they share it)."""
    return lock[:lock.rindex(":lock")] + ":fence"


def handoff_call(keys: LockKeys, exec_id: str, next_retries: int, lease_ms: int
                 ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``handoff.lua``."""
    return [keys.lock], [exec_id, next_retries, lease_ms]


def reclaim_call(keys: LockKeys, request: Request, token: int, fin_ms: int,
                 *, keep_ms: int, deadline_ms: int = 0) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``reclaim.lua``: write back a held lock the server forgot.

    The key's ``back`` hash, which tells the other slots of a ``singleton_limit``
    key that the counter they find was recreated by a write-back, lives a
    whole lease and a second (:func:`back_ms`).
    """
    lease_ms = request.lease.ms
    rest = record_rest(request, fin_ms)
    return [keys.lock, keys.fence, keys.back], [request.exec_id, lease_ms, token, rest,
                                                back_ms(lease_ms),
                                                fence_ttl_ms(lease_ms, keep_ms), deadline_ms]


def back_ms(lease_ms: int) -> int:
    """How long a key's ``back`` hash lives after a write-back (reclaim.lua): a
    lease and a second. A holder whose lease is still valid may write its slot
    back until the lease runs out, however late its renewer runs (a starved
    process's came after a third of the lease and a second had passed, its
    slot was granted to a third execution, and N + 1 ran); a slot nobody
    writes back stays refused that long after the empty restart."""
    return lease_ms + 1000


def fence_call(keys: LockKeys, exec_id: str, token: int, keep_ms: int
               ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``fence.lua``: raise the key's counter to ``token``."""
    return [keys.lock, keys.fence], [exec_id, token, keep_ms]
