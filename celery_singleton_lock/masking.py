"""Moved in 0.2: the 0.1 path ``celery_singleton_lock.masking``, kept until
0.3 with a ``DeprecationWarning``. Write
``from celery_singleton_lock import install_masking``."""

import warnings

from .observe.masking import install

warnings.warn("celery_singleton_lock.masking is deprecated and goes in 0.3: "
              "from celery_singleton_lock import install_masking",
              DeprecationWarning, stacklevel=2)

__all__ = ["install"]
