"""Worker bootstep: check every setting at start, report held locks in stats."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from .config import get_config, reset_config
from .exceptions import ConfigurationError

logger = logging.getLogger("celery_singleton_lock")


def validate_app(app: Any) -> None:
    """Raise ConfigurationError for the first bad app setting or task option."""
    from .task import SingletonTask

    reset_config(app)
    get_config(app)
    for task in list(app.tasks.values()):
        if isinstance(task, SingletonTask):
            task._singleton_settings_cache = None
            task.singleton_settings()


class SingletonStep(bootsteps.Step):  # type: ignore[misc]
    """Added to every app that has a SingletonTask; runs in the main worker process."""

    name = "celery_singleton_lock"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        try:
            validate_app(parent.app)
        except ConfigurationError as exc:
            logger.critical("celery-singleton-lock: %s", exc)
            raise SystemExit(f"celery-singleton-lock configuration error: {exc}") from None
        from .signals import watch_revoke_command

        watch_revoke_command()

    def info(self, parent: Any) -> dict[str, Any]:
        config = get_config(parent.app)
        return {"singleton": {"redis": _safe_url(config.redis_url), "ttl": config.ttl}}


def _safe_url(url: str) -> str:
    """The URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
