"""Ship an order once, however many times it is asked for."""

import redis
from celery import shared_task
from django.conf import settings
from django.db import transaction

from celery_singleton_lock import SingletonTask
from celery_singleton_lock.fencing import django_update

from .models import Order

#: the demo's stand-in for booking the courier: a list it pushes to once it has
#: seen every duplicate answered (so the booking lasts until then, however slow
#: the machine; 30 s at most)
COURIER = "demo:courier:{order_id}"
_couriers = redis.Redis.from_url(f"{settings.REDIS}/3")


# Task options stay lower case: they are arguments, not settings.
@shared_task(base=SingletonTask, bind=True, singleton_key=("order_id",))
def ship_order(self, order_id):
    _couriers.blpop([COURIER.format(order_id=order_id)], timeout=30)  # book the courier
    with transaction.atomic():
        django_update(Order.objects.filter(pk=order_id), self.singleton, state="shipped")
    return {"order_id": order_id, "key": self.singleton.key, "token": self.singleton.token}
