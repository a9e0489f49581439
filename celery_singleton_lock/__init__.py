"""Singleton Celery tasks: one execution per task and arguments, with a Redis lock
that lives exactly as long as its execution.

Importing the package opens no connection, starts no thread and connects no
signal: the worker step that ``SingletonTask`` adds to its app does the wiring
when a worker starts.
"""

from __future__ import annotations

from .config import SingletonConfig, get_config
from .conflict.results import DeduplicatedResult, is_deduplicated, is_skipped
from .exceptions import (
    ConfigurationError,
    DuplicateTaskError,
    InvalidArgumentsError,
    KeyEncodingError,
    LockBackendError,
    LockLostError,
    QuorumError,
    SingletonError,
    StaleTokenError,
    TooFewReplicasError,
    UnexpectedReplyError,
)
from .lock import SingletonLock
from .task import SingletonTask, send_task

__version__ = "0.2.0"

__all__ = [
    "ConfigurationError",
    "DeduplicatedResult",
    "DuplicateTaskError",
    "InvalidArgumentsError",
    "KeyEncodingError",
    "LockBackendError",
    "LockLostError",
    "QuorumError",
    "SingletonConfig",
    "SingletonError",
    "SingletonLock",
    "SingletonTask",
    "StaleTokenError",
    "TooFewReplicasError",
    "UnexpectedReplyError",
    "__version__",
    "get_config",
    "is_deduplicated",
    "is_skipped",
    "send_task",
]
