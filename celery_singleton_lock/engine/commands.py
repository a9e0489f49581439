"""The lock's operations as plain commands, no script (:mod:`.native`): a few
commands the wire writes at once and reads the replies of, as it writes one
script call.

A :class:`Commands` stands where a :class:`~.scripts.Script` does on the wire
(a call, a call sent without waiting, a call owed until the server answers
again), so the outage handling of :mod:`.wire` serves both. The commands are
those of a server that compares before it writes: ``SET ... IFEQ`` (Valkey
8.1+, Redis 8.4+) and a compare-and-delete, ``DELIFEQ key value`` (Valkey
9.0+) or ``DELEX key IFEQ value`` (Redis 8.4+, Valkey 9.2+).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .scripts import pack

#: one command: its name and arguments
Command = tuple[Any, ...]
#: the owner record's fields before the task id, which is the rest of it:
#: exec, handoff, copies, token, at, lease, fin, retries, pid, hostkey, host, name
FIELDS = 12


@dataclass(frozen=True)
class Commands:
    """Commands written together. By default ARGV holds them and KEYS is empty
    (so a call owed while the server is silent is sent again as it was);
    ``write`` makes one fixed sequence from KEYS and ARGV instead."""

    name: str
    write: Optional[Callable[[Sequence[str], Sequence[Any]], tuple[bytes, int]]] = None
    #: never a script's: nothing to load on a server that lost its scripts
    source: Optional[str] = None

    def packed(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[bytes, int]:
        """The commands in RESP, one write, and how many replies they get:
        written as one string (text that is not ASCII, whose bulk lengths
        count bytes, goes through :func:`~.scripts.pack`)."""
        if self.write is not None:
            return self.write(keys, args)
        out: list[str] = []
        for command in args:
            out.append(f"*{len(command)}\r\n")
            for arg in command:
                text = arg if arg.__class__ is str else str(arg)
                out.append(f"${len(text)}\r\n{text}\r\n")
        data = "".join(out)
        if data.isascii():
            return data.encode(), len(args)
        return b"".join([pack(c) for c in args]), len(args)


#: what the native path sends: ``wire.call(COMMANDS, [], [command, ...])``
COMMANDS = Commands("commands")


def _grant(keys: Sequence[str], args: Sequence[Any]) -> tuple[bytes, int]:
    """KEYS lock, fence, fin[, done]; ARGV the owner record, the lease ms, the
    proposed token, the counter's TTL ms, the deadline and when a grant not
    confirmed by then expires (server ms; 0, 0: none). Take the lock if free
    (the holder's record when not) and read its remaining ms, create the
    counter at the token if there is none (the counter when there is), read
    the finish and done markers, then the clock; written whole, one string,
    as a task's script calls are (:mod:`.scripts`).

    With a deadline the lock is set to expire at it (``PXAT``), then, in the
    same write, at ``confirm_by`` if it is still the record just set
    (``IFEQ``), as a script's grant lives until then unless its holder
    confirms it (grant_ttl in lua/_record.lua): a grant that reaches the
    server after its caller gave up expires the moment it is set (Redis
    writes no key set to expire in the past), and the second reply says so."""
    lock, fence, fin = keys[0], keys[1], keys[2]
    record, lease, token, fence_ms = args[0], str(args[1]), str(args[2]), str(args[3])
    deadline = str(args[4]) if len(args) > 4 and args[4] else ""
    if deadline:
        until = str(args[5])
        data = (f"*7\r\n$3\r\nSET\r\n${len(lock)}\r\n{lock}\r\n${len(record)}\r\n{record}\r\n"
                f"$2\r\nNX\r\n$4\r\nPXAT\r\n${len(deadline)}\r\n{deadline}\r\n$3\r\nGET\r\n"
                f"*7\r\n$3\r\nSET\r\n${len(lock)}\r\n{lock}\r\n${len(record)}\r\n{record}\r\n"
                f"$4\r\nIFEQ\r\n${len(record)}\r\n{record}\r\n$4\r\nPXAT\r\n${len(until)}\r\n"
                f"{until}\r\n")
        first: list[Command] = [("SET", lock, record, "NX", "PXAT", deadline, "GET"),
                                ("SET", lock, record, "IFEQ", record, "PXAT", until)]
    else:
        data = (f"*7\r\n$3\r\nSET\r\n${len(lock)}\r\n{lock}\r\n${len(record)}\r\n{record}\r\n"
                f"$2\r\nNX\r\n$2\r\nPX\r\n${len(lease)}\r\n{lease}\r\n$3\r\nGET\r\n")
        first = [("SET", lock, record, "NX", "PX", lease, "GET")]
    data += (f"*2\r\n$4\r\nPTTL\r\n${len(lock)}\r\n{lock}\r\n"
             f"*7\r\n$3\r\nSET\r\n${len(fence)}\r\n{fence}\r\n${len(token)}\r\n{token}\r\n"
             f"$2\r\nNX\r\n$2\r\nPX\r\n${len(fence_ms)}\r\n{fence_ms}\r\n$3\r\nGET\r\n"
             f"*2\r\n$3\r\nGET\r\n${len(fin)}\r\n{fin}\r\n")
    if len(keys) > 3:
        done = keys[3]
        data += f"*2\r\n$3\r\nGET\r\n${len(done)}\r\n{done}\r\n"
    data += "*1\r\n$4\r\nTIME\r\n"
    count = len(keys) + 1 + len(first)
    if data.isascii():
        return data.encode(), count
    commands: list[Command] = [*first, ("PTTL", lock),
                               ("SET", fence, token, "NX", "PX", fence_ms, "GET"),
                               ("GET", fin), *[("GET", k) for k in keys[3:]], ("TIME",)]
    return b"".join([pack(c) for c in commands]), count


#: a grant (:meth:`.native.Native.acquire`): its replies are the holder's
#: record or None, [with a deadline: "OK" when the grant was set to wait for
#: its confirmation,] the lock's remaining ms, the counter or None, the finish
#: marker, [the done marker,] the clock
GRANT = Commands("grant", _grant)


@dataclass(frozen=True)
class Flavor:
    """How one server spells compare-and-delete."""

    name: str
    #: the command that names it in ``COMMAND INFO``
    command: str

    def delete_if(self, key: str, value: str) -> Command:
        """Delete ``key`` if it holds ``value``: 1 deleted, 0 not."""
        if self.command == "delifeq":
            return ("DELIFEQ", key, value)
        return ("DELEX", key, "IFEQ", value)


VALKEY = Flavor("DELIFEQ", "delifeq")
REDIS = Flavor("DELEX IFEQ", "delex")
#: in the order looked for (a Valkey 9.2 has both)
FLAVORS = (VALKEY, REDIS)


# -- the owner record, as the scripts' prelude writes it (lua/_record.lua) ----

def new_record(exec_id: str, token: int, at: int, rest: str) -> str:
    """An owner record (docs/redis-keys.md), as ``new_record`` in ``_record.lua``."""
    return f"{exec_id}\n\n\n{token}\n{at}\n{rest}"


def fields_of(record: str) -> list[str]:
    return record.split("\n", FIELDS)


def with_token(record: str, token: int, at: int) -> str:
    f = record.split("\n", 5)
    return "\n".join((f[0], f[1], f[2], str(token), str(at), f[5]))


def with_copies(record: str) -> str:
    f = record.split("\n", 3)
    return "\n".join((f[0], f[1], "1", f[3]))


def task_of(marker: str) -> str:
    """The task id of a finish or done marker: after the name, when it has one."""
    return marker.partition("\n")[2] or marker
