"""`celery singleton ...` as users run it."""
