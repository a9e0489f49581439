"""Moved in 0.2: the 0.1 path ``celery_singleton_lock.overlap``, kept until
0.3 with a ``DeprecationWarning``. Write
``from celery_singleton_lock import cancel_requested``."""

import warnings

from .worker.ticks import cancel_requested

warnings.warn("celery_singleton_lock.overlap is deprecated and goes in 0.3: "
              "from celery_singleton_lock import cancel_requested",
              DeprecationWarning, stacklevel=2)

__all__ = ["cancel_requested"]
