"""Server replies whose shape depends on the redis-py version and the protocol.

redis-py parses a reply by the first word of the command it sent: a command
sent whole through ``execute_command`` (``CONFIG GET``, ``ACL LOG``) comes back
parsed into a dict by redis-py 5 and later, but as the server's flat list of
names and values by redis-py 4 (and over RESP3 as a map). A Redis Cluster
client answers a command sent to every node as a dict by node. The checks and
the CLI read such replies only through this module.
"""

from __future__ import annotations

from typing import Any, Optional


def text(value: Any) -> str:
    """A reply part as text: bytes decoded (a client without decode_responses)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def as_dict(reply: Any) -> dict[str, Any]:
    """A map reply as a dict with text keys: a dict as it is (RESP3, or parsed
    by redis-py), a flat ``[name, value, name, value, ...]`` list (RESP2 and
    redis-py 4), or a list of ``[name, value]`` pairs. Anything else: empty."""
    if isinstance(reply, dict):
        return {text(k): v for k, v in reply.items()}
    if isinstance(reply, (list, tuple)):
        if reply and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in reply):
            return {text(k): v for k, v in reply}
        items = list(reply)
        return {text(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}
    return {}


def config_value(reply: Any, name: str) -> Optional[str]:
    """One setting from a ``CONFIG GET <name>`` reply, None when not there.

    A Cluster client may answer with a dict by node whose values are the
    nodes' replies: the first node's value is taken."""
    found = as_dict(reply)
    if name in found:
        return text(found[name])
    for value in found.values():
        if isinstance(value, (dict, list, tuple)):
            inner = as_dict(value)
            if name in inner:
                return text(inner[name])
    return None


def info_dict(reply: Any) -> dict[str, Any]:
    """An ``INFO`` reply as a dict: parsed already by redis-py, or the raw
    ``name:value`` text a connection of our own reads."""
    if isinstance(reply, dict):
        return {text(k): v for k, v in reply.items()}
    out: dict[str, Any] = {}
    for line in text(reply).splitlines():
        if line and not line.startswith("#") and ":" in line:
            name, value = line.split(":", 1)
            out[name] = value.strip()
    return out


def entries(reply: Any) -> list[dict[str, Any]]:
    """A list of map replies (``ACL LOG``), each as a dict with text keys."""
    if not isinstance(reply, (list, tuple)):
        return []
    return [as_dict(entry) for entry in reply]
