"""The waits the library schedules, as the broker can carry them, and the
headers a message sent again leaves behind: no servers (nothing connects)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock.conflict.broker import (
    BROKER_HEADERS,
    DEAD_LETTER_HEADERS,
    native_delayed_delivery,
    schedulable,
    without_broker_headers,
)

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def app_with(broker: str, **conf: Any) -> Celery:
    app = Celery("transport", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="work", **conf)
    return app


QUORUM = {"task_default_queue_type": "quorum", "task_default_exchange_type": "topic"}


def test_quorum_queues_on_rabbitmq_wait_at_least_a_second():
    app = app_with("amqp://guest:guest@127.0.0.1:1//", **QUORUM)
    if not native_delayed_delivery(app):
        pytest.skip("Celery before 5.5: no native delayed delivery")
    assert [schedulable(app, s) for s in (0.05, 0.2, 0.99, 1.0, 1.2, 2.0, 29.7)] == [
        1.0, 1.0, 1.0, 1.0, 1.2, 2.0, 29.7]
    assert schedulable(app, 0) == 0  # no countdown at all: sent as it is


def test_what_celery_makes_of_the_rounded_wait_is_a_routing_key_kombu_takes():
    pytest.importorskip("kombu.transport.native_delayed_delivery")
    from kombu.transport.native_delayed_delivery import calculate_routing_key

    app = app_with("amqp://guest:guest@127.0.0.1:1//", **QUORUM)
    for wait in (0.16, 0.5, 0.8, 0.999):
        with pytest.raises(ValueError):  # what Celery's send_task did with the wait as it was
            calculate_routing_key(int(wait), "work")
        calculate_routing_key(int(schedulable(app, wait)), "work")


@pytest.mark.parametrize("broker,conf", [
    ("amqp://guest:guest@127.0.0.1:1//", {}),  # classic queues: the worker holds the ETA
    ("redis://127.0.0.1:1/0", QUORUM),  # not RabbitMQ: no queue types at all
])
def test_other_brokers_and_queue_types_keep_the_wait_as_it_is(broker, conf):
    app = app_with(broker, **conf)
    assert not native_delayed_delivery(app)
    assert [schedulable(app, s) for s in (0.2, 1.2, 7.0)] == [0.2, 1.2, 7.0]


def test_a_message_sent_again_leaves_the_brokers_headers_behind():
    headers = {
        "x-death": [{"queue": "celery_delayed_0", "reason": "expired", "count": 1}],
        "x-first-death-exchange": "celery_delayed_0",
        "x-first-death-queue": "celery_delayed_0",
        "x-first-death-reason": "expired",
        "x-last-death-exchange": "celery_delayed_0",
        "x-last-death-queue": "celery_delayed_0",
        "x-last-death-reason": "expired",
        "x-delivery-count": 3,
        "singleton_waits": 2,
        "tenant": "acme",
    }
    assert without_broker_headers(headers) == {"singleton_waits": 2, "tenant": "acme"}
    assert without_broker_headers(None) == {}
    assert DEAD_LETTER_HEADERS <= BROKER_HEADERS


def test_the_dead_letter_headers_include_every_one_celery_leaves_out_of_a_retry():
    task_module = pytest.importorskip("celery.app.task")
    celerys = getattr(task_module, "X_DEATH_HEADERS", None)
    if celerys is None:
        pytest.skip("Celery before 5.6.3 leaves them on a retry")
    assert set(celerys) <= BROKER_HEADERS
