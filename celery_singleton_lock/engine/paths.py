"""Which way a task's lock calls go on one server, chosen once from what the
server offers: plain commands (:mod:`.native`) where it compares before it
writes and the task's options need nothing more, scripts otherwise.

The choice is asked of the server once per URL and process tree (the worker's
main process asks before its pool forks, and the children inherit it): its
command table names the compare-and-delete (``COMMAND INFO``), one call of it
shows the user may run it (else scripts, as before), and one script call
shows whether it runs scripts at all (some managed deployments and ACL users
may not). Where it runs none, the native path is the only one, and a
task whose options need a script is refused at start (:func:`unserved`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional

import redis

from ..config import SingletonConfig
from ..process import ForkSafeLock
from .commands import COMMANDS, FLAVORS, Flavor
from .scripts import Script


@dataclass(frozen=True)
class Path:
    """What one server offers the lock."""

    #: its compare-and-delete, when it has one and ``singleton_native`` allows
    native: Optional[Flavor]
    #: it runs our scripts
    scripts: bool = True

    def describe(self) -> str:
        if self.native is None:
            return "scripts"
        if not self.scripts:
            return f"native commands only ({self.native.name}, SET IFEQ; the server runs no script)"
        return f"native commands ({self.native.name}, SET IFEQ) where a task's options allow, " \
               "scripts for the rest"


SCRIPTS_ONLY = Path(None)

_chosen: dict[tuple[str, str], Path] = {}
_chosen_lock = ForkSafeLock()


def choose(config: SingletonConfig, call: Any, probe: Script) -> Path:
    """The path of ``config``'s server, asked once (``call``: the wire's
    ``call``, ``probe``: a harmless script of ours)."""
    key = (config.redis_url, config.native)
    path = _chosen.get(key)
    if path is None:
        with _chosen_lock:
            path = _chosen.get(key)
            if path is None:
                path = _ask(config, call, probe)
                _chosen[key] = path
    return path


def forget() -> None:
    """Ask again (a test that moved a server)."""
    with _chosen_lock:
        _chosen.clear()


def _ask(config: SingletonConfig, call: Any, probe: Script) -> Path:
    if config.native == "off":
        return SCRIPTS_ONLY
    try:
        found, _ = call(COMMANDS, [], [("COMMAND", "INFO", *(f.command for f in FLAVORS))])
    except redis.ResponseError:  # COMMAND not allowed to this user: scripts, as before
        return SCRIPTS_ONLY
    flavor = next((f for f, info in zip(FLAVORS, found or []) if info), None)
    if flavor is None:
        return SCRIPTS_ONLY
    key = f"{config.key_prefix}{{{uuid.uuid4().hex}}}:probe"
    try:  # an ACL user may be refused the command the server has
        call(COMMANDS, [], [flavor.delete_if(key, "probe")])
    except redis.ResponseError:
        return SCRIPTS_ONLY
    try:
        call(probe, [key], ["probe"])
    except redis.ResponseError as exc:
        if refuses_scripts(exc):
            return Path(flavor, scripts=False)
        raise
    return Path(flavor)


def refuses_scripts(exc: redis.ResponseError) -> bool:
    """The server or the ACL user runs no script: not permitted, or no such
    command (renamed away, scripting disabled)."""
    text = str(exc).lower()
    return isinstance(exc, redis.exceptions.NoPermissionError) or "unknown command" in text \
        or "noperm" in text or ("scripting" in text and "disabled" in text)
