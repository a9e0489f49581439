"""The doctor: checks of the lock Redis, shared by the CLI and the worker's start.

``checks.acl_rule`` and ``checks.run_checks`` (0.1's paths) still answer, with
a ``DeprecationWarning``, until 0.3: both are in the package's face now.
"""

from __future__ import annotations

import warnings
from typing import Any

#: 0.1's names here -> where they are now (both also in ``celery_singleton_lock``)
_MOVED = {"acl_rule": "permissions", "run_checks": "doctor"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"celery_singleton_lock.checks.{name} is deprecated and goes in 0.3: "
                  f"from celery_singleton_lock import {name}", DeprecationWarning,
                  stacklevel=2)
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_MOVED[name]}"), name)
    globals()[name] = value  # warned once: ``from ... import`` looks twice
    return value
