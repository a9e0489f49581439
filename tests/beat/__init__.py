"""Beat without a leader: real beat processes, overlap modes, django-celery-beat."""
