"""The hold time histogram's fields, counted in this process (no Redis needed:
with no engine, nothing is published)."""

from __future__ import annotations

import pytest

from celery_singleton_lock.observe import monitor

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def test_a_hold_lands_in_the_first_bucket_at_least_as_long():
    publisher = monitor.PUBLISHER
    publisher.reset()
    try:
        for seconds in (0.0, 0.1, 0.2, 1.0, 4.0, 1e9):
            monitor.observe_hold(None, "t.x", seconds)
        counts = dict(publisher._counts.get(0, {}))
    finally:
        publisher.reset()
    buckets = {name.split("|")[3]: n for name, n in counts.items()
               if name.startswith("hold_bucket|t.x|")}
    # a bound is inclusive: 0.1 s is in the 0.1 bucket, 1.0 s in the 1.0 one
    assert buckets == {"0.1": 2, "0.5": 1, "1.0": 1, "5.0": 1, "+Inf": 1}
    sums = [n for name, n in counts.items() if name.startswith("hold_sum|t.x|")]
    assert sums == [0.0 + 0.1 + 0.2 + 1.0 + 4.0 + 1e9]
    assert publisher._thread is None  # nothing to publish to: no thread


def test_the_metrics_register_while_the_lock_redis_does_not_answer():
    """Flower reads its configuration file (register(...), flower_format_task(...))
    at start, perhaps before the lock Redis answers: neither reads Redis then,
    so Flower starts; the series are named all the same."""
    import socket

    from prometheus_client import CollectorRegistry

    from celery_singleton_lock.observe.metrics import register

    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{held.getsockname()[1]}/2"
        registry = CollectorRegistry()
        register(url, registry=registry)
        names = set(registry._names_to_collectors)
        assert {"celery_singleton_acquisitions_total", "celery_singleton_locks_held",
                "celery_singleton_hold_seconds"} <= names
        assert callable(monitor.flower_format_task(url))
