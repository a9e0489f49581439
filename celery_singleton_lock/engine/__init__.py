"""Everything that talks to the lock Redis; no Celery in here."""
