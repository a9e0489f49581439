"""Settings of the example shop. ``SHOP_REDIS_URL``, ``SHOP_DB`` and
``SHOP_QUEUE`` come from the environment (the demo sets them)."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
REDIS = os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS: list[str] = []
INSTALLED_APPS = ["orders"]
USE_TZ = True
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", str(BASE_DIR / "shop.sqlite3")),
        "OPTIONS": {"timeout": 30},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Celery, read by shop/celery.py with namespace="CELERY"
CELERY_BROKER_URL = f"{REDIS}/0"
CELERY_RESULT_BACKEND = f"{REDIS}/1"
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_QUEUE", "shop")
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# celery-singleton-lock: singleton_* settings, typed as CELERY_SINGLETON_*
CELERY_SINGLETON_REDIS_URL = f"{REDIS}/2"
CELERY_SINGLETON_KEY_PREFIX = "shop-locks:"
CELERY_SINGLETON_TTL = 20
CELERY_SINGLETON_ON_DUPLICATE = "skip"
CELERY_SINGLETON_ON_BACKEND_ERROR = "retry"
