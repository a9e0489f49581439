"""Flower's configuration in the compose stack (``--conf=flowerconfig.py``): the
lock metrics on Flower's ``/metrics``, and a running task's lock on its page."""

from __future__ import annotations

import os

from celery_singleton_lock import flower_format_task
from celery_singleton_lock import register_metrics as register

LOCKS = f"{os.environ.get('REDIS_URL', 'redis://redis:6379')}/2"  # proj.py's singleton_redis_url

register(LOCKS)
format_task = flower_format_task(LOCKS)
