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
from typing import Any, Optional, Sequence

from .scripts import pack

#: one command: its name and arguments
Command = tuple[Any, ...]
#: the owner record's fields before the task id, which is the rest of it:
#: exec, handoff, copies, token, at, lease, fin, retries, pid, hostkey, host, name
FIELDS = 12


@dataclass(frozen=True)
class Commands:
    """Commands written together: ARGV holds them, KEYS is empty (so a call
    owed while the server is silent is sent again as it was)."""

    name: str
    #: never a script's: nothing to load on a server that lost its scripts
    source: Optional[str] = None

    def packed(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[bytes, int]:
        """The commands in RESP, one write, and how many replies they get."""
        return b"".join([pack(c) for c in args]), len(args)


#: what the native path sends: ``wire.call(COMMANDS, [], [command, ...])``
COMMANDS = Commands("commands")


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
