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

    def __post_init__(self) -> None:
        object.__setattr__(self, "head", _bulks(["EVALSHA", self.sha]))

    @classmethod
    def load(cls, name: str) -> Script:
        source = resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


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
    return b"*%d\r\n%s%s" % (len(keys) + len(args) + 3, script.head,
                               _bulks([len(keys), *keys, *args]))
