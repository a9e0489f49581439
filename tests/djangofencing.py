"""``python -m tests.djangofencing``: django_update on a model with a fence field,
in an in-memory SQLite database; prints ``fenced`` when every check holds.
Run by tests/lock/test_fencing.py in a process of its own (Django is configured
once per process)."""

from __future__ import annotations

from typing import Any

import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=[], USE_TZ=True,
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
)
django.setup()

from django.db import connection, models  # noqa: E402

from celery_singleton_lock import StaleTokenError  # noqa: E402
from celery_singleton_lock.fencing import django_update  # noqa: E402

TOKEN = 1_795_448_446_403_762


class Order(models.Model):  # type: ignore[misc]
    state = models.TextField()
    fence = models.BigIntegerField(default=0)

    class Meta:
        app_label = "fencing"

    objects: Any


def main() -> None:
    with connection.schema_editor() as editor:
        editor.create_model(Order)
    Order.objects.create(id=42, state="new")
    assert django_update(Order.objects.filter(pk=42), TOKEN, state="paid") == 1
    try:
        django_update(Order.objects.filter(pk=42), TOKEN - 1, state="refunded")
    except StaleTokenError as err:
        assert (err.table, err.row, err.token, err.stored) == (
            "fencing_order", {"pk": 42}, TOKEN - 1, TOKEN), err.args
    else:
        raise AssertionError("a stale token wrote")
    assert Order.objects.get(pk=42).state == "paid"
    assert django_update(Order.objects.filter(pk=42), TOKEN, state="shipped") == 1
    try:
        django_update(Order.objects.filter(pk=42), TOKEN, strict=True, state="x")
    except StaleTokenError:
        pass
    else:
        raise AssertionError("strict=True let the same token write twice")
    try:
        django_update(Order.objects.filter(pk=7), TOKEN, state="x")
    except LookupError:
        pass
    else:
        raise AssertionError("a missing row was not reported")
    print("fenced")


if __name__ == "__main__":
    main()
