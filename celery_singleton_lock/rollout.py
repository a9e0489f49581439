"""A fleet moving over from celery-singleton or celery-once: their lock, taken too.

While old and new workers run side by side, the old ones take *their*
library's lock for a call when it is sent and delete it when its run ends;
they never look at ours. With ``singleton_also_lock`` a SingletonTask takes
that same lock for the same call, so an old worker and a new one never run one
call at once:

* **at send** the old library's key is taken as that library takes it (its
  key form, its expiry, ``SET NX``): a send that finds it taken is refused, as
  the old library refused it, whatever the scope;
* **at run** the key must be this message's (taken for it when it was sent)
  or free (taken now); another call's means that call runs on some worker:
  the execution is a duplicate and ``singleton_on_duplicate`` decides;
* **while it runs** the key lives as long as ours (renewed with it, so a
  killed worker leaves it for a lease, not for ever); every exit path deletes
  it if it is still this call's, as the old library's worker does at the end.

The two keys are taken one after the other, never at once: the old library's
first, then ours, and a refusal of ours gives the old one back. Since every
execution that runs holds both, and neither library's worker runs a call
whose key another holds, no order of the two steps lets two run at once; the
worst a crash between them costs is a duplicate told "held" for a lease.

celery-once writes a random token, not the task id, when it sends: a message
an old sender sent cannot be told from another call's by the value alone, so
a message that did not come from a SingletonTask (no ``singleton_also_lock``
header) adopts a held key as its own, as celery-once's worker would.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import redis

from .engine.scripts import Script
from .exceptions import ConfigurationError, describe

logger = logging.getLogger("celery_singleton_lock")

#: header a SingletonTask's send adds when it took the other library's key
SENT_HEADER = "singleton_also_lock"
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def singleton_key(prefix: str, task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
                  ) -> str:
    """celery-singleton's key: its prefix, then the MD5 of the task name and the
    JSON of the arguments as they were passed (keys sorted)."""
    text = (task_name + json.dumps(list(args), sort_keys=True)
            + json.dumps(dict(kwargs), sort_keys=True))
    return prefix + hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def _once_form(value: Any) -> Any:
    """celery-once's text of a value: a dict becomes its items written one by
    one, keys sorted; a list keeps its members so written; anything else as it is."""
    if isinstance(value, dict):
        pairs = [(_once_form(k), _once_form(v)) for k, v in sorted(value.items(),
                                                                  key=lambda kv: kv[0])]
        return "{" + ", ".join(str({k: v}).strip("{}") for k, v in pairs) + "}"
    if isinstance(value, list):
        return [_once_form(v) for v in value]
    return value


def once_key(task_name: str, arguments: Mapping[str, Any]) -> str:
    """celery-once's key: ``qo_<task>`` then ``<name>-<value>`` per argument,
    by name, each value as ``str()`` writes it."""
    parts = ["qo", task_name]
    parts += [f"{name}-{_once_form(value)}"
              for name, value in sorted(arguments.items(), key=lambda kv: kv[0])]
    return "_".join(parts)


@dataclass(frozen=True)
class OtherLibrary:
    """Where and how one task's calls are locked by the library the fleet leaves."""

    library: str
    task_name: str
    client: Any  # redis.Redis: the old library's lock Redis
    key_prefix: str
    #: what the old library gives a key taken at send (None: it never expires)
    expiry_ms: Optional[int]
    #: the arguments its key is made of (None: every argument as passed)
    names: Optional[tuple[str, ...]]
    signature: Optional[inspect.Signature]

    @classmethod
    def for_task(cls, spec: Mapping[str, Any], app: Any, task_name: str,
                 signature: Optional[inspect.Signature],
                 key_names: Optional[tuple[str, ...]], key_is_function: bool
                 ) -> OtherLibrary:
        """The other library of a task, its defaults read from ``app.conf`` as that
        library reads them (raises ConfigurationError naming what is missing)."""
        library = spec["library"]
        conf = app.conf
        names = spec.get("keys", key_names)
        if names is None and key_is_function:
            raise ConfigurationError(
                "singleton_also_lock", f"task {task_name!r}: its singleton_key is a function, "
                                       f"so the {library} key cannot be made from it: give "
                                       f"the old key's arguments as 'keys'")
        if library == "celery_singleton":
            url = spec.get("url") or conf.get("singleton_backend_url")
            if not url:
                backend = conf.get("result_backend")
                url = backend if isinstance(backend, str) and backend.startswith(
                    "redis://") else conf.get("broker_url")
            prefix = spec.get("key_prefix") or "SINGLETONLOCK_"
            expiry = spec.get("expiry", conf.get("singleton_lock_expiry"))
        else:
            once = conf.get("ONCE") or {}
            settings = once.get("settings", {}) if isinstance(once, Mapping) else {}
            url = spec.get("url") or settings.get("url")
            prefix = ""
            expiry = spec.get("expiry", settings.get("default_timeout", 3600))
        if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
            raise ConfigurationError(
                "singleton_also_lock", f"task {task_name!r}: no Redis URL for {library}'s "
                                       f"locks (got {url!r}): give it as 'url'")
        return cls(library=library, task_name=task_name, client=redis.Redis.from_url(url),
                   key_prefix=prefix, expiry_ms=None if expiry is None else int(expiry * 1000),
                   names=names, signature=signature)

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Optional[str]:
        """The other library's key for this call as it was passed; None when that
        library could not make one (it would have failed to send the call)."""
        args, kwargs = args or (), kwargs or {}
        try:
            if self.library == "celery_singleton":
                if self.names:
                    bound = self._bound(args, kwargs)
                    return singleton_key(self.key_prefix, self.task_name, [],
                                         {n: bound[n] for n in self.names})
                return singleton_key(self.key_prefix, self.task_name, args, kwargs)
            bound = self._bound(args, kwargs)
            if self.names is not None:
                bound = {n: bound[n] for n in self.names}
            return once_key(self.task_name, bound)
        except (TypeError, ValueError, KeyError):
            return None

    def _bound(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments by name, as passed: both libraries apply no defaults."""
        if self.signature is None:
            raise TypeError("no signature")
        return dict(self.signature.bind(*args, **kwargs).arguments)

    def take_at_send(self, key: str, task_id: str) -> Optional[str]:
        """Take ``key`` as the old library does when it sends; the holder's value
        when it is taken."""
        if self.client.set(key, task_id, nx=True, px=self.expiry_ms):
            return None
        value = self.client.get(key)
        return value.decode("utf-8", "replace") if value is not None else "?"

    def lock(self, key: str, task_id: str, *, adopt: bool) -> OtherLock:
        return OtherLock(self, key, task_id, adopt)


class OtherLock:
    """The old library's lock of one execution. ``kept``: left for a retry."""

    __slots__ = ("adopt", "kept", "key", "library", "task_id", "value")

    def __init__(self, library: OtherLibrary, key: str, task_id: str, adopt: bool) -> None:
        self.library = library
        self.key = key
        self.task_id = task_id
        self.adopt = adopt
        self.value = task_id
        self.kept = False

    def take(self, lease_ms: int) -> Optional[str]:
        """This execution's key now (None), or the value of the call that has it."""
        ours, value = _TAKE(keys=[self.key], args=[self.task_id, lease_ms, int(self.adopt)],
                            client=self.library.client)
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if not ours:
            return text
        self.value = text  # the task id, or celery-once's token of this very message
        return None

    def keep(self, ms: int) -> None:
        """Keep it ``ms`` longer from now (a renewal, or a retry's countdown)."""
        _KEEP(keys=[self.key], args=[self.value, ms], client=self.library.client)

    def release(self) -> None:
        """Delete it if it is still this call's (redis errors are logged: it then
        lives out its lease)."""
        try:
            _KEEP(keys=[self.key], args=[self.value, 0], client=self.library.client)
        except redis.RedisError as exc:
            logger.warning("Could not delete %s's lock %s: %s (it frees within its lease)",
                           self.library.library, self.key, describe(exc))


def renew(locks: Sequence[tuple[OtherLock, int]]) -> None:
    """Renew the old library's locks of the executions a heartbeat round renewed."""
    for lock, lease_ms in locks:
        try:
            lock.keep(lease_ms)
        except redis.RedisError as exc:
            logger.warning("Could not renew %s's lock %s: %s", lock.library.library,
                           lock.key, describe(exc))


def _script(name: str) -> Any:
    # the old library's Redis is a plain client of its own: redis-py's script
    # object (EVALSHA, loaded when missing), with our script's source
    return redis.Redis().register_script(Script.load(name).source)


_TAKE = _script("old_take")
_KEEP = _script("old_keep")
