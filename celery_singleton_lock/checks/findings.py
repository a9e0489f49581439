"""What a check of the lock Redis says (:class:`Finding`), and the few reads
every check shares: one command, one setting, the connection's user and db.

No Celery import: the checks need only a redis-py client and the settings.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

import redis

from ..engine import shapes

logger = logging.getLogger("celery_singleton_lock")

ERROR = "error"
WARNING = "warning"
OK = "ok"


@dataclass(frozen=True)
class Finding:
    """One thing a check saw: ``level`` is error, warning or ok; ``action`` says
    what to do about it (empty when nothing is to be done)."""

    level: str
    code: str
    message: str
    action: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def advice(self) -> str:
        """``<message>. What to do: <action>``, with one full stop however the
        message ends (a server's error text may bring its own)."""
        return f"{sentence(self.message)} What to do: {self.action}"


def sentence(text: str) -> str:
    """``text`` ending in one full stop."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


def client_kwargs(client: redis.Redis) -> dict[str, Any]:
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a RedisCluster: the options every node connection gets
        return dict(client.get_connection_kwargs())
    return dict(pool.connection_kwargs)


def db_of(client: redis.Redis) -> int:
    return int(client_kwargs(client).get("db") or 0)


def user_of(client: redis.Redis) -> str:
    return str(client_kwargs(client).get("username") or "default")


def command(client: redis.Redis, *args: Any) -> Any:
    """One command, its reply parsed by redis-py (typed for the checks)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def setting(client: redis.Redis, name: str) -> Optional[str]:
    """One server setting (CONFIG GET), whatever shape redis-py gives it."""
    return shapes.config_value(command(client, "CONFIG", "GET", name), name)


def server_text(exc: BaseException) -> str:
    """The server's error text; a password is never in it."""
    return str(exc).strip() or type(exc).__name__


