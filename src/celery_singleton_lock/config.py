"""Settings, read once from ``app.conf`` (every name starts with ``singleton_``)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from .exceptions import ConfigurationError

DUPLICATE_POLICIES = ("skip", "retry", "raise")
BACKEND_ERROR_POLICIES = ("retry", "run", "raise")
SCOPES = ("run", "queue", "queue_and_run")

DEFAULTS: dict[str, Any] = {
    "singleton_redis_url": None,  # None: the broker URL when it is Redis
    "singleton_key_prefix": "singleton:",
    "singleton_ttl": 30.0,
    "singleton_on_duplicate": "skip",
    "singleton_on_backend_error": "retry",
    "singleton_retry_delay": 1.0,
    "singleton_retry_max_delay": 30.0,
    "singleton_finished_ttl": 3600.0,
    "singleton_scope": "run",
    "singleton_done_ttl": 0,  # 0 or None: off
    "singleton_queue_ttl": 300.0,
    "singleton_redis_options": {},
}

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_ttl(setting: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(setting, f"expected a number of seconds, got {value!r}")
    if not value > 0:
        raise ConfigurationError(setting, f"must be greater than 0, got {value!r}")
    return float(value)


def check_optional_ttl(setting: str, value: Any) -> float:
    """A number of seconds, or 0 / None for off."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return 0.0
    return check_ttl(setting, value)


def check_choice(setting: str, value: Any, choices: tuple[str, ...],
                 what: str = "policy") -> str:
    if value not in choices:
        raise ConfigurationError(
            setting, f"unknown {what} {value!r}; expected one of: {', '.join(choices)}"
        )
    return str(value)


@dataclass(frozen=True)
class SingletonConfig:
    redis_url: str
    key_prefix: str = "singleton:"
    ttl: float = 30.0
    on_duplicate: str = "skip"
    on_backend_error: str = "retry"
    retry_delay: float = 1.0
    retry_max_delay: float = 30.0
    finished_ttl: float = 3600.0
    scope: str = "run"
    done_ttl: float = 0.0
    queue_ttl: float = 300.0
    redis_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_app(cls, app: Any) -> SingletonConfig:
        conf = app.conf

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        done_ttl = conf.get("singleton_done_ttl")

        url = get("singleton_redis_url") or _redis_broker_url(conf.get("broker_url"))
        if not url:
            raise ConfigurationError(
                "singleton_redis_url",
                "not set, and the broker is not Redis: set singleton_redis_url = "
                "'redis://host:6379/0'",
            )
        if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
            raise ConfigurationError(
                "singleton_redis_url", f"expected a redis://, rediss:// or unix:// URL, got {url!r}"
            )
        prefix = get("singleton_key_prefix")
        if not isinstance(prefix, str):
            raise ConfigurationError("singleton_key_prefix", f"expected a string, got {prefix!r}")
        options = get("singleton_redis_options")
        if not isinstance(options, dict):
            raise ConfigurationError("singleton_redis_options", f"expected a dict, got {options!r}")
        return cls(
            redis_url=url,
            key_prefix=prefix,
            ttl=check_ttl("singleton_ttl", get("singleton_ttl")),
            on_duplicate=check_choice(
                "singleton_on_duplicate", get("singleton_on_duplicate"), DUPLICATE_POLICIES
            ),
            on_backend_error=check_choice(
                "singleton_on_backend_error",
                get("singleton_on_backend_error"),
                BACKEND_ERROR_POLICIES,
            ),
            retry_delay=check_ttl("singleton_retry_delay", get("singleton_retry_delay")),
            retry_max_delay=check_ttl(
                "singleton_retry_max_delay", get("singleton_retry_max_delay")
            ),
            finished_ttl=check_ttl("singleton_finished_ttl", get("singleton_finished_ttl")),
            scope=check_choice("singleton_scope", get("singleton_scope"), SCOPES, "scope"),
            done_ttl=check_optional_ttl("singleton_done_ttl", done_ttl),
            queue_ttl=check_ttl("singleton_queue_ttl", get("singleton_queue_ttl")),
            redis_options=dict(options),
        )


def _redis_broker_url(broker: Any) -> Optional[str]:
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else None
    if isinstance(broker, str):
        first = broker.split(";")[0].strip()
        if first.startswith(_REDIS_SCHEMES):
            return first
    return None


_cache: weakref.WeakKeyDictionary[Any, SingletonConfig] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def get_config(app: Any) -> SingletonConfig:
    """The app's settings, validated and cached on first use."""
    config = _cache.get(app)
    if config is None:
        with _cache_lock:
            config = _cache.get(app)
            if config is None:
                config = SingletonConfig.from_app(app)
                _cache[app] = config
    return config


def reset_config(app: Any) -> None:
    """Forget the cached settings of ``app`` (after changing ``app.conf``)."""
    with _cache_lock:
        _cache.pop(app, None)
