"""Moved in 0.2: the 0.1 path ``celery_singleton_lock.replies``, kept until
0.3 with a ``DeprecationWarning``. Write
``from celery_singleton_lock import owner_record``."""

import warnings

from .engine.replies import record

warnings.warn("celery_singleton_lock.replies is deprecated and goes in 0.3: "
              "from celery_singleton_lock import owner_record",
              DeprecationWarning, stacklevel=2)

__all__ = ["record"]
