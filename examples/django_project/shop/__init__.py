"""The project package: importing it loads the Celery app, so `@shared_task`
tasks bind to it."""

from .celery import app as celery_app

__all__ = ["celery_app"]
