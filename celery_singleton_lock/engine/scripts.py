"""Our Lua scripts as the wire sends them: each one's SHA, and a call of one
written in RESP by hand (``EVALSHA <sha> <numkeys> <keys> <args>``).

Our arguments are only str and int, so the packing is a few byte formats,
with the ``EVALSHA <sha>`` head of each script packed once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Sequence


@dataclass(frozen=True)
class Script:
    """One of the ``lua/*.lua`` scripts, called by its SHA."""

    name: str
    source: str
    sha: str
    #: ``$7 EVALSHA $40 <sha>``, packed once: every call starts with it
    head: bytes = field(init=False, repr=False, compare=False)
    #: the same as text, for the calls written whole (:func:`evalsha`)
    head_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", _bulks(["EVALSHA", self.sha]))
        object.__setattr__(self, "head_text", self.head.decode())

    @classmethod
    def load(cls, name: str) -> Script:
        """``lua/<name>.lua`` after the prelude every script shares (the owner
        record's layout, ``lua/_record.lua``)."""
        source = read_source(PRELUDE) + read_source(name)
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


#: the prelude of every script: the owner record's layout, written once
PRELUDE = "_record"


def read_source(name: str) -> str:
    """The text of ``lua/<name>.lua``."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def pack(parts: Sequence[Any]) -> bytes:
    """One RESP command; our arguments are only str and int."""
    return b"*%d\r\n%s" % (len(parts), _bulks(parts))


def _bulks(parts: Sequence[Any]) -> bytes:
    out = []
    for part in parts:
        data = part.encode() if isinstance(part, str) else b"%d" % part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def evalsha(script: Script, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    """``EVALSHA <sha> <numkeys> <keys> <args>`` in RESP."""
    # A task's two calls, in one string each: its acquire (three keys, or
    # four with a done window; the task id, the execution id, the lease ms,
    # the record, the counter's TTL ms, the deadline, the confirmation's) and
    # its release (two keys; the execution id, the mode). Written whole, they
    # cost half the CPU of the loop below; text that is not ASCII (a bulk's
    # length counts bytes) goes through the loop.
    if len(args) == 7 and 3 <= len(keys) <= 4:
        a1, a2, a3, a4, a5, a6, a7 = args
        if a1.__class__ is str and a2.__class__ is str and a3.__class__ is int \
                and a4.__class__ is str and a5.__class__ is int and a6.__class__ is int \
                and a7.__class__ is int:
            s3, s5, s6, s7 = str(a3), str(a5), str(a6), str(a7)
            names = "".join([f"${len(k)}\r\n{k}\r\n" for k in keys])
            text = (f"*{len(keys) + 10}\r\n{script.head_text}$1\r\n{len(keys)}\r\n{names}"
                    f"${len(a1)}\r\n{a1}\r\n${len(a2)}\r\n{a2}\r\n${len(s3)}\r\n{s3}\r\n"
                    f"${len(a4)}\r\n{a4}\r\n${len(s5)}\r\n{s5}\r\n${len(s6)}\r\n{s6}\r\n"
                    f"${len(s7)}\r\n{s7}\r\n")
            if text.isascii():
                return text.encode()
    elif len(keys) == 2 and len(args) == 2:
        a1, a2 = args
        if a1.__class__ is str and a2.__class__ is int:
            k1, k2 = keys
            s2 = str(a2)
            text = (f"*7\r\n{script.head_text}$1\r\n2\r\n"
                    f"${len(k1)}\r\n{k1}\r\n${len(k2)}\r\n{k2}\r\n${len(a1)}\r\n{a1}\r\n"
                    f"${len(s2)}\r\n{s2}\r\n")
            if text.isascii():
                return text.encode()
    return b"*%d\r\n%s%s" % (len(keys) + len(args) + 3, script.head,
                               _bulks([len(keys), *keys, *args]))
