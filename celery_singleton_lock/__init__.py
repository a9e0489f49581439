"""Singleton Celery tasks: one execution per task and arguments, with a Redis lock
that lives exactly as long as its execution.

Importing the package opens no connection, starts no thread and connects no
signal: the worker step that ``SingletonTask`` adds to its app does the wiring
when a worker starts.

This is the public API; the subpackages are the library's own rooms
(CONTRIBUTING.md has the map). ``celery_singleton_lock.beat`` (the scheduler)
and ``celery_singleton_lock.testing`` (the pytest plugin) are public too.
"""

from __future__ import annotations

import typing as _typing

from .checks.doctor import run_checks
from .checks.permissions import acl_rule
from .config import SingletonConfig, get_config
from .conflict.results import DeduplicatedResult, is_deduplicated, is_skipped
from .engine.replies import record as owner_record
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
    UnconfirmedHolderError,
    UnexpectedReplyError,
)
from .lock import SingletonLock
from .observe.masking import install as install_masking
from .observe.monitor import flower_format_task
from .task import SingletonTask, send_task
from .worker.ticks import cancel_requested

__version__ = "0.2.0"


def register_metrics(source: _typing.Any, prefix: str = "singleton:",
                     registry: _typing.Optional[_typing.Any] = None) -> _typing.Any:
    """Add the locks' Prometheus series to ``registry`` (prometheus_client's
    default: the one Flower's ``/metrics`` serves). ``source``: the lock Redis
    URL or a Celery app. Needs the ``metrics`` extra."""
    from .observe.metrics import register

    return register(source, prefix, registry)


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
    "UnconfirmedHolderError",
    "UnexpectedReplyError",
    "__version__",
    "acl_rule",
    "cancel_requested",
    "flower_format_task",
    "get_config",
    "install_masking",
    "is_deduplicated",
    "is_skipped",
    "owner_record",
    "register_metrics",
    "run_checks",
    "send_task",
]
