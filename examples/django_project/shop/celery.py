"""The Celery app, configured from Django's settings: every ``CELERY_*`` name
there is a Celery setting, the library's ``singleton_*`` ones included
(``CELERY_SINGLETON_TTL`` is ``singleton_ttl``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
