"""The hold time histogram's fields, counted in this process (no Redis needed:
with no engine, nothing is published)."""

from __future__ import annotations

from celery_singleton_lock import monitor


def test_a_hold_lands_in_the_first_bucket_at_least_as_long():
    publisher = monitor.PUBLISHER
    publisher.reset()
    try:
        for seconds in (0.0, 0.1, 0.2, 1.0, 4.0, 1e9):
            monitor.observe_hold(None, "t.x", seconds)
        counts = dict(publisher._counts)
    finally:
        publisher.reset()
    buckets = {name.split("|")[3]: n for name, n in counts.items()
               if name.startswith("hold_bucket|t.x|")}
    # a bound is inclusive: 0.1 s is in the 0.1 bucket, 1.0 s in the 1.0 one
    assert buckets == {"0.1": 2, "0.5": 1, "1.0": 1, "5.0": 1, "+Inf": 1}
    sums = [n for name, n in counts.items() if name.startswith("hold_sum|t.x|")]
    assert sums == [0.0 + 0.1 + 0.2 + 1.0 + 4.0 + 1e9]
    assert publisher._thread is None  # nothing to publish to: no thread
