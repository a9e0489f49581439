"""``celery -A app singleton list|key|release|purge|doctor``: see and fix locks."""

from __future__ import annotations

from ..observe import masking
from .commands import singleton

# Celery imports this package for every `celery` command: it is the
# `celery.commands` entry point, the one hook Celery gives an extension in its
# CLI. So the CLI installs password masking here, and `celery report` and the
# commands below print the lock Redis's password masked (a worker's own
# `inspect conf` replies are masked by the worker step, which installs it too).
masking.install()

__all__ = ["singleton"]
