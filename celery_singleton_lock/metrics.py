"""Moved in 0.2: the 0.1 path ``celery_singleton_lock.metrics``, kept until
0.3 with a ``DeprecationWarning``. Write
``from celery_singleton_lock.observe.metrics import register``."""

import warnings

from .observe.metrics import register

warnings.warn("celery_singleton_lock.metrics is deprecated and goes in 0.3: "
              "from celery_singleton_lock.observe.metrics import register",
              DeprecationWarning, stacklevel=2)

__all__ = ["register"]
