from django.db import models


class Order(models.Model):
    state = models.CharField(max_length=20, default="new")
    # the last fencing token that wrote the row (celery_singleton_lock.fencing)
    fence = models.BigIntegerField(default=0)

    class Meta:
        app_label = "orders"
