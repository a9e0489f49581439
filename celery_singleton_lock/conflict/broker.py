"""What the broker lets the library's own messages be: a wait it can schedule,
and a message sent again without the broker's bookkeeping.

**At least a second under native delayed delivery.** Celery 5.5 and later, on
RabbitMQ with a quorum queue among the app's queues, sends a message with a
countdown or an ETA through RabbitMQ's native delayed delivery: it turns the
countdown into a routing key with ``int(countdown)`` (``celery/app/base.py``,
``send_task``), and kombu refuses 0 with ``ValueError('countdown must be a
positive number')`` (``kombu/transport/native_delayed_delivery.py``,
``calculate_routing_key``). A wait under a second raised there, in the pool
process, and the task was recorded as failed. Every wait the
library schedules (a duplicate under ``retry``, a redelivered copy waiting for
its original, the lock Redis unreachable, a throttle window, a debounce) goes
through :func:`schedulable`: there a wait under a second becomes one second.
A longer one keeps its fraction, as any countdown does with Celery: the delay
queues hold the message for the whole seconds and the worker holds it until
its ETA for the rest. Rounding every wait to whole seconds was tried: it
throws away the backoff's jitter, so duplicates sent together come back
together, and 16 duplicates behind a 45 s holder took 110.7 s after it to
finish where classic queues took 43.9 s.

**No dead-letter headers on a message sent again.** A message that went
through a delay queue carries RabbitMQ's ``x-death`` headers (the queues it
was dead-lettered from, and why). Celery drops them from a retry since 5.7 and
5.6.3 (``Context.as_execution_options``, celery/celery#9867, PR #10095):
RabbitMQ before 4.0.1 takes a message dead-lettered into a queue already
named in its ``x-death``, with no rejection in between, for a cycle: it drops
it, or a quorum delay queue (``at-least-once`` dead-lettering) keeps it. A
delayed message sent again with those headers makes that trip whenever its
wait passes through a delay queue it passed before (3 s after an earlier 3 s:
the 2 s queue dead-letters into the 1 s one). The
library's own resend gives Celery the headers it keeps, so it leaves out the
same set, and ``x-delivery-count``: the count of a quorum queue's redeliveries
of *that* message, which a new message does not inherit.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

#: RabbitMQ's dead-lettering headers, the set Celery leaves out of a retry
#: (``celery.app.task.X_DEATH_HEADERS``; listed here for Celery before 5.6.3)
DEAD_LETTER_HEADERS = frozenset({
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
})

#: what a quorum queue writes on a message it delivers again
DELIVERY_COUNT_HEADER = "x-delivery-count"


def _broker_headers() -> frozenset[str]:
    try:  # whatever a later Celery adds to its own list is left out too
        from celery.app.task import X_DEATH_HEADERS
    except ImportError:  # Celery before 5.6.3
        return DEAD_LETTER_HEADERS | {DELIVERY_COUNT_HEADER}
    return DEAD_LETTER_HEADERS | {DELIVERY_COUNT_HEADER} | frozenset(X_DEATH_HEADERS)


#: headers the broker wrote on the message received, never carried to a new one
BROKER_HEADERS = _broker_headers()


def without_broker_headers(headers: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """A request's custom headers less the broker's own bookkeeping."""
    if not isinstance(headers, Mapping):
        return {}
    return {k: v for k, v in headers.items() if k not in BROKER_HEADERS}


def native_delayed_delivery(app: Any) -> bool:
    """Whether Celery sends this app's countdowns through RabbitMQ's native
    delayed delivery: Celery 5.5+, an ``amqp`` transport and a quorum queue
    among the app's queues (the test ``send_task`` itself makes)."""
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # Celery before 5.5: the worker holds ETA messages itself
        return False
    driver = app.producer_pool.connections.connection.transport.driver_type
    return bool(detect_quorum_queues(app, driver)[0])


def schedulable(app: Any, seconds: float) -> float:
    """``seconds`` as a countdown the app's broker can carry: unchanged, or
    one second for a wait under a second under native delayed delivery."""
    if not 0 < seconds < 1 or not native_delayed_delivery(app):
        return seconds
    return 1.0
