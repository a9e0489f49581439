"""A script call as the wire writes it: the task's two calls written whole are
byte for byte what the general packing writes, and what it cannot write whole
(text that is not ASCII, other types, other shapes) goes the general way."""

from __future__ import annotations

from typing import Any

import pytest

from celery_singleton_lock.engine.calls import SCRIPTS
from celery_singleton_lock.engine.scripts import _bulks, evalsha

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

KEYS4 = ["sl:{0123456789abcdef0123456789abcdef}:lock", "sl:{0123}:fence", "f", ""]


def general(keys: list[str], args: list[Any]) -> bytes:
    """RESP of EVALSHA, one bulk per part: what redis-py's packing writes too."""
    script = SCRIPTS["acquire"]
    return b"*%d\r\n%s%s" % (len(keys) + len(args) + 3, script.head,
                             _bulks([len(keys), *keys, *args]))


@pytest.mark.parametrize("keys,args", [
    (KEYS4, ["d3b07384d113edec49eaa6238ad5ff00", "1a2b-17f", 3600000,
             "3600000\n60000\n0\n1234\nhostkey\nw@h\nt.name\nd3b07384"]),
    (KEYS4, ["", "", 0, ""]),
    (KEYS4, ["id", "e", -1, "a\r\n$5\r\n*"]),       # protocol bytes inside a bulk
    (KEYS4, ["id", "e", 10 ** 30, "rest"]),          # a long number
    (KEYS4, ["id", "e", 5, "w@hôte"]),                # not ASCII: bytes, not characters
    (KEYS4, ["id\u20ac", "e", 5, "r"]),
    (["clé", "b", "c", "d"], ["id", "e", 5, "r"]),
    (KEYS4, ["id", "e", True, "r"]),                  # a bool is written as a number
    (KEYS4, ["id", "e", "5", "r"]),
    (KEYS4, ["id", 7, 5, "r"]),
    (KEYS4[:2], ["exec", 1]),
    (KEYS4[:2], ["exec", 12345]),
    (KEYS4[:2], ["exéc", 0]),
    (KEYS4[:2], ["exec", False]),
    (KEYS4[:2], ["exec", "1"]),
    (KEYS4[:3], ["exec", 1, "id", 60000]),
    ([], []),
])
def test_every_call_is_written_as_the_general_packing_writes_it(keys: list[str],
                                                                 args: list[Any]) -> None:
    assert evalsha(SCRIPTS["acquire"], keys, args) == general(keys, args)


def test_a_lone_surrogate_fails_as_the_general_packing_does() -> None:
    for keys, args in ((KEYS4, ["\ud800", "e", 5, "r"]), (KEYS4[:2], ["\ud800", 1])):
        with pytest.raises(UnicodeEncodeError):
            general(keys, args)
        with pytest.raises(UnicodeEncodeError):
            evalsha(SCRIPTS["acquire"], keys, args)


def test_the_owner_record_layout_is_written_once_for_lua_and_python():
    """Every script starts with the prelude that names the owner record's fields;
    it lists them in the order Python reads them (``replies.RECORD_FIELDS``), and
    no script spells a record pattern of its own."""
    import re
    from importlib import resources

    from celery_singleton_lock.engine.calls import SCRIPTS
    from celery_singleton_lock.engine.replies import RECORD_FIELDS
    from celery_singleton_lock.engine.scripts import PRELUDE

    lua = resources.files("celery_singleton_lock.engine").joinpath("lua")
    prelude = lua.joinpath(f"{PRELUDE}.lua").read_text()
    listed = re.search(r"^--\s+(exec handoff .*)$", prelude, re.M)
    assert listed and tuple(listed.group(1).split()) == RECORD_FIELDS
    for script in SCRIPTS.values():
        assert script.source.startswith(prelude)
        own = lua.joinpath(f"{script.name}.lua").read_text()
        # a record is matched field by field only through the prelude's patterns
        assert "[^\\n]*\\n[^\\n]*\\n" not in own, script.name
