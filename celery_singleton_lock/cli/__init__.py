"""``celery -A app singleton list|key|release|purge|doctor``: see and fix locks."""

from __future__ import annotations

from .commands import singleton

__all__ = ['singleton']
