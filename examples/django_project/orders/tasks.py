"""Ship an order once, however many times it is asked for."""

import time

from celery import shared_task
from django.db import transaction

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.fencing import django_update

from .models import Order


# Task options stay lower case: they are arguments, not settings.
@shared_task(base=SingletonTask, bind=True, singleton_key=("order_id",))
def ship_order(self, order_id):
    time.sleep(1.0)  # book the courier
    with transaction.atomic():
        django_update(Order.objects.filter(pk=order_id), self.singleton, state="shipped")
    return {"order_id": order_id, "key": self.singleton.key, "token": self.singleton.token}
