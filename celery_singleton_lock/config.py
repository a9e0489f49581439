"""Settings: one table gives every setting's name, default, check and whether a
task may override it. Read once from ``app.conf`` (every name starts with
``singleton_``) into a :class:`SingletonConfig` cached per app.

Over 500 lines: the table, the checks of its values, the names it refuses
(misspelt ones, the peers' options) and the checks of settings together are
one idea, what a user may write and what it means.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

from .exceptions import ConfigurationError
from .process import ForkSafeLock
from .urls import parse

logger = logging.getLogger("celery_singleton_lock")

OnDuplicate = Literal["skip", "retry", "raise", "replace"]
OnBackendError = Literal["retry", "run", "raise"]
Scope = Literal["run", "queue", "queue_and_run"]
WaitPolicy = Literal["release", "proceed"]
OverlapMode = Literal["skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other",
                      "allow"]

DUPLICATE_POLICIES: tuple[OnDuplicate, ...] = ("skip", "retry", "raise", "replace")
BACKEND_ERROR_POLICIES: tuple[OnBackendError, ...] = ("retry", "run", "raise")
SCOPES: tuple[Scope, ...] = ("run", "queue", "queue_and_run")
WAIT_POLICIES: tuple[WaitPolicy, ...] = ("release", "proceed")
OVERLAP_MODES: tuple[OverlapMode, ...] = ("skip", "buffer_one", "buffer_all", "cancel_other",
                                          "terminate_other", "allow")
BEAT_BACKEND_ERROR_POLICIES = ("skip", "send")
NATIVE = ("auto", "off")

#: ``singleton_on_duplicate="replace"``: a send takes the place of a call still queued
REPLACE: OnDuplicate = "replace"

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_DEPLOY_SCHEMES = ("sentinel://", "sentinels://", "cluster://", "clusters://", "redlock://",
                   "redlocks://")


# -- checks: each takes the setting's name and value, returns the value to keep ------

def check_ttl(setting: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(setting, f"expected a number of seconds, got {value!r}")
    if not value > 0:
        raise ConfigurationError(setting, f"must be greater than 0, got {value!r}")
    return float(value)


def check_optional_ttl(setting: str, value: Any) -> float:
    """A number of seconds, or 0 / None for off (the message says so)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(setting, f"expected a number of seconds, or 0 or None for "
                                          f"off, got {value!r}")
    if not value > 0:
        raise ConfigurationError(setting, f"must be greater than 0, or 0 or None for off, "
                                          f"got {value!r}")
    return float(value)


def choice(choices: tuple[str, ...], what: str = "policy") -> Callable[[str, Any], str]:
    def check(setting: str, value: Any) -> str:
        if value not in choices:
            raise ConfigurationError(
                setting, f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
        return str(value)
    return check


def check_positive_count(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(setting, f"expected a whole number >= 1, got {value!r}")
    return value


def check_count(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(setting, f"expected a whole number >= 0, got {value!r}")
    return value


def check_limit(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(setting, f"expected a whole number >= 1, got {value!r}")
    return value


def check_ms(setting: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(setting, f"expected milliseconds, a whole number > 0, "
                                          f"got {value!r}")
    return value


#: seconds of each unit a rate may be given in (``singleton_rate``)
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smhd])\s*$")


@functools.lru_cache(maxsize=256)
def parse_rate(text: str) -> tuple[int, int]:
    """``"10/m"``, ``"100/30s"``, ``"5/2h"`` as (starts, window in ms); raises ValueError."""
    found = _RATE.match(text)
    if found is None:
        raise ValueError(text)
    count, amount, unit = found.groups()
    window_ms = round(float(amount or 1) * _RATE_UNITS[unit] * 1000)
    if int(count) < 1 or window_ms < 1:
        raise ValueError(text)
    return int(count), window_ms


def check_rate(setting: str, value: Any) -> str:
    """A string ``"<starts>/<window>"`` (``""``: no limit)."""
    if value == "":
        return ""
    if isinstance(value, str):
        try:
            parse_rate(value)
            return value.strip()
        except ValueError:
            pass
    raise ConfigurationError(
        setting, f"expected '<starts>/<window>' such as '10/m', '100/30s' or '5/2h' "
                 f"(at most that many starts of one key in any such window, across "
                 f"every worker), got {value!r}")


def check_str(setting: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(setting, f"expected a string, got {value!r}")
    return value


def check_dict(setting: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(setting, f"expected a dict, got {value!r}")
    return dict(value)


#: the libraries a fleet may move over from (``singleton_also_lock``, :mod:`.rollout`)
LIBRARIES = ("celery_singleton", "celery_once")
_ALSO_LOCK_FIELDS = ("library", "url", "key_prefix", "expiry", "keys")


def check_also_lock(setting: str, value: Any) -> dict[str, Any]:
    """``"celery_singleton"``, ``"celery_once"`` or a dict with ``library`` and
    any of ``url``, ``key_prefix``, ``expiry`` (seconds, or None: never) and
    ``keys`` (the argument names the old key is made of)."""
    spec = {"library": value} if isinstance(value, str) else value
    if not isinstance(spec, Mapping):
        raise ConfigurationError(setting, f"expected 'celery_singleton', 'celery_once' or a "
                                          f"dict with 'library', got {value!r}")
    spec = dict(spec)
    if spec.get("library") not in LIBRARIES:
        raise ConfigurationError(setting, f"unknown library {spec.get('library')!r}; expected "
                                          f"one of: {', '.join(LIBRARIES)}")
    unknown = sorted(set(spec) - set(_ALSO_LOCK_FIELDS))
    if unknown:
        raise ConfigurationError(setting, f"unknown field {', '.join(map(repr, unknown))}; "
                                          f"expected some of: {', '.join(_ALSO_LOCK_FIELDS)}")
    url = spec.get("url")
    if url is not None and not (isinstance(url, str) and url.startswith(_REDIS_SCHEMES)):
        raise ConfigurationError(setting, f"url: expected a redis://, rediss:// or unix:// "
                                          f"URL (where the old library keeps its locks), "
                                          f"got {url!r}")
    expiry = spec.get("expiry")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, (int, float))
                               or expiry <= 0):
        raise ConfigurationError(setting, f"expiry: expected seconds > 0 or None (never), "
                                          f"got {expiry!r}")
    keys = spec.get("keys")
    if keys is not None:
        names = (keys,) if isinstance(keys, str) else keys
        if not isinstance(names, Sequence) or not names or not all(
                isinstance(n, str) for n in names):
            raise ConfigurationError(setting, f"keys: expected argument names, got {keys!r}")
        spec["keys"] = tuple(names)
    prefix = spec.get("key_prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise ConfigurationError(setting, f"key_prefix: expected a string, got {prefix!r}")
    return spec


def check_url(setting: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(_REDIS_SCHEMES + _DEPLOY_SCHEMES):
        raise ConfigurationError(
            setting, f"expected a redis://, rediss:// or unix:// URL (or sentinel://, "
                     f"cluster://, redlock://: docs/deployments.md), got {value!r}")
    if value.startswith(_DEPLOY_SCHEMES):
        try:
            parse(value)
        except ValueError as exc:
            raise ConfigurationError(setting, f"{exc} in {value.split('@')[-1]!r}") from None
    return value


@dataclass(frozen=True)
class Setting:
    """One row of the table: ``singleton_<field>``."""

    field: str
    default: Any
    check: Callable[[str, Any], Any]
    #: a task may set it too (decorator argument or class attribute)
    per_task: bool = False

    @property
    def name(self) -> str:
        return f"singleton_{self.field}"


SETTINGS: tuple[Setting, ...] = (
    # None: the broker URL when the broker is Redis (see _default_redis_url)
    Setting("redis_url", None, check_url),
    Setting("redis_options", {}, check_dict),
    Setting("key_prefix", "singleton:", check_str),
    Setting("ttl", 30.0, check_ttl, per_task=True),
    Setting("on_duplicate", "skip", choice(DUPLICATE_POLICIES), per_task=True),
    Setting("scope", "run", choice(SCOPES, "scope"), per_task=True),
    Setting("done_ttl", 0.0, check_optional_ttl, per_task=True),
    Setting("throttle", 0.0, check_optional_ttl, per_task=True),
    # "10/m": at most 10 starts of one key in any minute, fleet-wide (docs/rate.md)
    Setting("rate", "", check_rate, per_task=True),
    Setting("limit", 1, check_limit, per_task=True),
    # with on_duplicate "replace": the queued call starts this long after the
    # latest send, but never later than debounce_max after the burst's first
    Setting("debounce", 0.0, check_optional_ttl, per_task=True),
    Setting("debounce_max", 0.0, check_optional_ttl, per_task=True),
    Setting("on_backend_error", "retry", choice(BACKEND_ERROR_POLICIES)),
    Setting("retry_delay", 1.0, check_ttl),
    Setting("retry_max_delay", 30.0, check_ttl),
    Setting("finished_ttl", 3600.0, check_ttl),
    Setting("queue_ttl", 300.0, check_ttl),
    # how long a key's fencing counter outlives its lock (docs/fencing.md#retention)
    Setting("fence_ttl", 300.0, check_ttl),
    # "auto": plain commands, no script, for the tasks they can serve, on a
    # server that compares before it writes (Valkey 9.0+, Redis 8.4+); "off":
    # scripts only (docs/deployments.md#native-commands)
    Setting("native", "auto", choice(NATIVE, "value")),
    # WAIT after each grant and renewal: replicas that must acknowledge (0: off),
    # how long to wait for them, what to do when fewer did (docs/deployments.md)
    Setting("wait_replicas", 0, check_count),
    Setting("wait_timeout", 100, check_ms),
    Setting("wait_policy", "release", choice(WAIT_POLICIES)),
    # when no replica acknowledged at all (none connected, as on a shard just
    # failed over): "" does as wait_policy says
    Setting("wait_no_replica", "", choice(("", *WAIT_POLICIES))),
    # while a fleet moves over from celery-singleton or celery-once: their lock
    # for the same call is taken too (docs/migration.md)
    Setting("also_lock", None, check_also_lock, per_task=True),
)

TASK_OPTIONS = tuple(s for s in SETTINGS if s.per_task)

#: the settings of beat (:func:`.beat.beat_config`): name, default, check
BEAT_SETTINGS: tuple[tuple[str, Any, Callable[[str, Any], Any]], ...] = (
    ("singleton_beat_catchup", 60.0, check_ttl),
    ("singleton_beat_on_backend_error", "skip", choice(BEAT_BACKEND_ERROR_POLICIES)),
    ("singleton_beat_overlap", "skip", choice(OVERLAP_MODES, "overlap mode")),
    ("singleton_beat_max_clock_skew", 30.0, check_ttl),
    ("singleton_beat_buffer_max", 10, check_positive_count),
)


# -- names: a misspelt one is refused, celery-singleton's are named -------------------

APP_SETTING_NAMES = frozenset([s.name for s in SETTINGS] + [name for name, *_ in BEAT_SETTINGS])
#: what a task may set (``singleton_key`` is read by :class:`.keys.KeyBuilder`)
TASK_OPTION_NAMES = frozenset([s.name for s in TASK_OPTIONS] + ["singleton_key"])

#: celery-singleton's app settings (``singleton_key_prefix`` is ours too), with
#: what replaces each here (docs/migration.md). A migration keeps both
#: libraries in one app for a while, and celery-singleton's own tasks still
#: read these, so they are named in a warning, not refused.
CELERY_SINGLETON_SETTINGS = {
    "singleton_backend_url": "singleton_redis_url",
    "singleton_backend_class": "singleton_redis_url (Redis only)",
    "singleton_backend_kwargs": "singleton_redis_options",
    "singleton_raise_on_duplicate": 'singleton_on_duplicate="raise"',
    "singleton_lock_expiry": "singleton_ttl (a lease renewed while the task runs)",
}


def _names_of(value: Any) -> str:
    names = (value,) if isinstance(value, str) else tuple(value or ())
    return f"singleton_key={names!r}"


def _once_replacement(value: Any) -> str:
    """What a celery-once ``once={...}`` option becomes here."""
    once = dict(value) if isinstance(value, Mapping) else {}
    parts = []
    if once.get("keys") is not None:
        parts.append(_names_of(once["keys"]))
    scope = "queue" if once.get("unlock_before_run") else "queue_and_run"
    parts.append(f"singleton_scope={scope!r} (the key taken at send, as celery-once did)")
    parts.append("singleton_on_duplicate='skip'" if once.get("graceful")
                 else "singleton_on_duplicate='raise'")
    if once.get("timeout") is not None:
        parts.append("singleton_ttl (a lease renewed while the task runs, "
                     "not the longest a run may take)")
    return ", ".join(parts)


#: the task options of celery-singleton and celery-once, each with what it
#: becomes here, made from its value. A SingletonTask that still sets one is
#: refused (docs/migration.md says why: an option read by neither library
#: would change the key or the duplicates' fate without a word).
PEER_TASK_OPTIONS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "unique_on": ("celery-singleton", _names_of),
    "raise_on_duplicate": ("celery-singleton", lambda v: (
        "singleton_on_duplicate='raise'" if v else "nothing (a duplicate is skipped or "
                                                   "refused by default)")),
    "lock_expiry": ("celery-singleton", lambda v: (
        "singleton_ttl (a lease renewed while the task runs, not the longest a run may take)")),
    "challenge_lock_on_startup": ("celery-singleton", lambda v: (
        "nothing (a dead holder's lock frees itself)")),
    "once": ("celery-once", _once_replacement),
}


def did_you_mean(name: str, names: Any, written: Optional[str] = None) -> str:
    """``; did you mean singleton_ttl?`` for the closest of ``names``, in the
    form the user wrote (``CELERY_SINGLETON_TTL`` under a namespace)."""
    # compared without the prefix every name shares, which would make any two alike
    tails = {n[len("singleton_"):]: n for n in names}
    close = [tails[t] for t in difflib.get_close_matches(name[len("singleton_"):],
                                                          sorted(tails), n=1)]
    if not close:
        return ""
    if written and written != name:
        close[0] = written[:len(written) - len(name)] + close[0].upper()
    return f"; did you mean {close[0]}?"


#: celery-singleton settings already named in a warning by this process
_WARNED: set[str] = set()


def check_app_names(conf: Any) -> None:
    """Refuse a ``singleton_*`` setting no table has (ConfigurationError naming
    it and the closest known name); name celery-singleton's in a warning."""
    for written, name in _singleton_names(conf):
        if name in APP_SETTING_NAMES:
            continue
        if name in CELERY_SINGLETON_SETTINGS:
            if written in _WARNED:  # once per process: the settings are read more than once
                continue
            _WARNED.add(written)
            logger.warning("celery-singleton-lock: the setting %s belongs to celery-singleton "
                           "and is not read here; use %s", written,
                           CELERY_SINGLETON_SETTINGS[name])
            continue
        hint = did_you_mean(name, APP_SETTING_NAMES, written)
        raise ConfigurationError(written, f"unknown setting{hint or ' (docs/settings.md)'}")


def _singleton_names(conf: Any) -> list[tuple[str, str]]:
    """The ``singleton_*`` settings in ``conf``: each as written and as Celery
    reads it (without the namespace of ``config_from_object(..., namespace=...)``)."""
    prefix = str(getattr(conf, "prefix", None) or "")
    found = set()
    for key in list(conf.keys()):
        if not isinstance(key, str):
            continue
        name = key
        if prefix and key.upper().startswith(prefix.upper()):
            name = key[len(prefix):].lower()
        if name.startswith("singleton_"):
            found.add((key, name))
    return sorted(found)


def check_task_names(task_name: str, options: Mapping[str, Any]) -> None:
    """Refuse a task's ``singleton_*`` option that is none of ours, naming the
    task and the closest option, and an option of celery-singleton or
    celery-once, naming what replaces it here (``options``: name -> value)."""
    for name in sorted(options):
        if name in PEER_TASK_OPTIONS:
            library, replacement = PEER_TASK_OPTIONS[name]
            raise ConfigurationError(
                name, f"task {task_name!r}: an option of {library}, which celery-singleton-lock "
                      f"does not read; use {replacement(options[name])} (docs/migration.md)")
        if name.startswith("singleton_") and name not in TASK_OPTION_NAMES:
            if name in APP_SETTING_NAMES:
                detail = "an app setting, not a task option: set it in app.conf"
            else:
                hint = did_you_mean(name, TASK_OPTION_NAMES)
                detail = f"unknown task option{hint or ' (docs/settings.md)'}"
            raise ConfigurationError(name, f"task {task_name!r}: {detail}")


@dataclass(frozen=True)
class SingletonConfig:
    """The checked settings of one app, or of one task (the app's with the task's
    own options over them). Field ``x`` is setting ``singleton_x``; defaults and
    checks live in :data:`SETTINGS`."""

    redis_url: str
    redis_options: dict[str, Any]
    key_prefix: str
    ttl: float
    on_duplicate: OnDuplicate
    scope: Scope
    done_ttl: float
    throttle: float
    rate: str
    limit: int
    debounce: float
    debounce_max: float
    on_backend_error: OnBackendError
    retry_delay: float
    retry_max_delay: float
    finished_ttl: float
    queue_ttl: float
    fence_ttl: float
    native: str
    wait_replicas: int
    wait_timeout: int
    wait_policy: WaitPolicy
    wait_no_replica: str
    also_lock: Optional[dict[str, Any]]

    @property
    def rate_window(self) -> tuple[int, int]:
        """``singleton_rate`` as (starts, window ms); (0, 0) without a limit."""
        return parse_rate(self.rate) if self.rate else (0, 0)

    @classmethod
    def from_app(cls, app: Any) -> SingletonConfig:
        """Read and check every setting of ``app.conf`` (raises ConfigurationError)."""
        conf = app.conf
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            value = conf.get(setting.name)
            if value is None and setting.field == "redis_url":
                value = _default_redis_url(conf)
            if value is None:
                values[setting.field] = setting.default
            else:
                values[setting.field] = setting.check(setting.name, value)
        check_app_names(conf)
        config = cls(**values)
        check_together("", config)
        return config

    @classmethod
    def defaults(cls, redis_url: str, **overrides: Any) -> SingletonConfig:
        """Every default, for code that uses the engine without a Celery app."""
        values = {s.field: s.default for s in SETTINGS}
        values.update(overrides, redis_url=redis_url)
        return cls(**values)

    def for_task(self, task_name: str, options: Mapping[str, Any]) -> SingletonConfig:
        """These settings with a task's own options (``singleton_ttl=...``) over them."""
        overrides: dict[str, Any] = {}
        for setting in TASK_OPTIONS:
            value = options.get(setting.name)
            if value is None:
                continue
            try:
                overrides[setting.field] = setting.check(setting.name, value)
            except ConfigurationError as exc:
                raise ConfigurationError(exc.setting, f"task {task_name!r}: {exc.detail}") from None
        config = dataclasses.replace(self, **overrides) if overrides else self
        check_together(task_name, config)
        return config


def check_together(task_name: str, config: SingletonConfig) -> None:
    """Settings that are fine alone and wrong together, named in a ConfigurationError."""
    where = f"task {task_name!r}: " if task_name else ""
    if config.limit > 1 and (config.scope != "run" or config.throttle):
        other = (f"singleton_scope={config.scope!r}" if config.scope != "run"
                 else "singleton_throttle")
        raise ConfigurationError("singleton_limit", f"{where}{config.limit} per key goes with "
                                 f"singleton_scope='run' only, without a throttle; "
                                 f"not with {other}")
    if config.rate and config.throttle:
        raise ConfigurationError("singleton_rate", f"{where}{config.rate!r} with "
                                                   f"singleton_throttle: choose one (a "
                                                   f"throttle is a rate of one)")
    if config.rate and config.redis_url.startswith(("redlock://", "redlocks://")):
        raise ConfigurationError("singleton_rate", f"{where}{config.rate!r} needs one lock Redis "
                                                   f"(a server, Sentinel or Cluster), not "
                                                   f"redlock://")
    if config.redis_url.startswith(("redlock://", "redlocks://")) and (
            config.limit > 1 or config.on_duplicate == REPLACE):
        # each master would grant its own slot, or keep its own queued call:
        # no majority agrees on either
        setting, what = (("singleton_limit", f"{config.limit} per key")
                         if config.limit > 1 else ("singleton_on_duplicate", "'replace'"))
        raise ConfigurationError(setting, f"{where}{what} needs one lock Redis (a server, "
                                          f"Sentinel or Cluster), not redlock://")
    if config.on_duplicate == REPLACE and config.scope == "run":
        raise ConfigurationError(
            "singleton_on_duplicate",
            f"{where}'replace' swaps a call that is still queued for the "
            f"new one, so it needs a send-time key: set singleton_scope='queue' or "
            f"'queue_and_run' (the scope is 'run')")
    if config.debounce and config.on_duplicate != REPLACE:
        raise ConfigurationError(
            "singleton_debounce",
            f"{where}debouncing pushes back the queued call each time a "
            f"send replaces it: set singleton_on_duplicate='replace' (it is "
            f"{config.on_duplicate!r})")
    if config.debounce_max and not config.debounce:
        raise ConfigurationError(
            "singleton_debounce_max", f"{where}caps singleton_debounce, "
                                      f"which is not set")
    if config.debounce_max and config.debounce_max < config.debounce:
        raise ConfigurationError(
            "singleton_debounce_max",
            f"{where}{config.debounce_max:g} s is shorter than "
            f"singleton_debounce ({config.debounce:g} s)")


def _default_redis_url(conf: Any) -> str:
    broker = conf.get("broker_url")
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else None
    if isinstance(broker, str):
        first = broker.split(";")[0].strip()
        if first.startswith(_REDIS_SCHEMES):
            return first
    raise ConfigurationError(
        "singleton_redis_url",
        "not set, and the broker is not Redis: set singleton_redis_url = "
        "'redis://host:6379/0'",
    )


_cache: weakref.WeakKeyDictionary[Any, SingletonConfig] = weakref.WeakKeyDictionary()
_cache_lock = ForkSafeLock()


def get_config(app: Any, *, reload: bool = False) -> SingletonConfig:
    """The app's settings, checked and cached on first use.

    ``reload=True`` reads ``app.conf`` again (the worker does at start, so a
    setting changed after the first send still counts there).
    """
    config: Optional[SingletonConfig] = None if reload else _cache.get(app)
    if config is None:
        with _cache_lock:
            config = None if reload else _cache.get(app)
            if config is None:
                config = SingletonConfig.from_app(app)
                _cache[app] = config
    return config
