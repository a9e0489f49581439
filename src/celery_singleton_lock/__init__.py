"""Singleton Celery tasks: one execution per task and arguments, with a Redis lock
that lives exactly as long as its execution."""

from __future__ import annotations

from . import signals as _signals
from .config import SingletonConfig, get_config
from .exceptions import (
    ConfigurationError,
    DuplicateTaskError,
    KeyEncodingError,
    LockBackendError,
    LockLostError,
    SingletonError,
)
from .lock import SingletonLock
from .policies import is_skipped
from .results import DeduplicatedResult, is_deduplicated
from .task import SingletonTask, send_task

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DeduplicatedResult",
    "DuplicateTaskError",
    "KeyEncodingError",
    "LockBackendError",
    "LockLostError",
    "SingletonConfig",
    "SingletonError",
    "SingletonLock",
    "SingletonTask",
    "__version__",
    "get_config",
    "is_deduplicated",
    "is_skipped",
    "send_task",
]

_signals.connect()
