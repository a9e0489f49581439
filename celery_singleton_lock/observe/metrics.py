"""Prometheus series of the locks (optional extra: ``pip install
celery-singleton-lock[metrics]``).

Counting happens wherever a lock is taken, skipped or refused: in pool
children of any number of workers, and in the processes that send tasks. Each
adds its counts to one hash in the lock Redis (:mod:`.monitor`, once per
publish interval, never on a task's round trip), so one scrape anywhere sees
them all. :class:`SingletonCollector` reads that hash (two ``HGETALL`` per
scrape) and serves it, labelled as celery-exporter labels its series: ``name``
(the task) and ``hostname`` (the worker, or the sending host for refusals).

Served two ways:

* by Flower's ``/metrics``, through its ``--conf`` file (Python)::

      # flowerconfig.py
      from celery_singleton_lock import register_metrics as register
      register("redis://lock-redis:6379/0")   # singleton_redis_url

* by ``celery -A proj singleton metrics --port 9808`` (its own HTTP server).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Union

import redis
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from . import monitor

#: counter -> (series name without ``_total``, help, has a reason label)
SERIES: dict[str, tuple[str, str, bool]] = {
    "acquired": ("celery_singleton_acquisitions", "Singleton locks taken", False),
    "skipped": ("celery_singleton_skips",
                "Duplicates skipped at run time, by reason (duplicate, done)", True),
    "refused": ("celery_singleton_refusals",
                "Sends refused at send time (queue scopes), by reason", True),
    "waited": ("celery_singleton_waits",
               "Duplicates sent again to wait for their key (retry policy)", False),
    "lost": ("celery_singleton_losses", "Locks lost while their task ran", False),
    "renew_failed": ("celery_singleton_renewal_failures",
                     "Lock renewals that could not reach Redis", False),
    "backend_errors": ("celery_singleton_backend_errors",
                       "Lock Redis errors at send or run, by phase", True),
}


class SingletonCollector(Collector):
    """Reads the counters and held locks every process published."""

    def __init__(self, client: redis.Redis, prefix: str = "singleton:") -> None:
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "singleton:",
                 **options: Any) -> SingletonCollector:
        return cls(redis.Redis.from_url(url, decode_responses=True, **options), prefix)

    @classmethod
    def from_app(cls, app: Any) -> SingletonCollector:
        from ..config import get_config

        config = get_config(app)
        return cls.from_url(config.redis_url, config.key_prefix, **config.redis_options)

    def describe(self) -> Iterator[Metric]:
        """The series without their samples, read from no Redis: registering
        works while the lock Redis is down (Flower reads its configuration
        file at start, perhaps before the lock Redis answers)."""
        for series, doc, with_reason in SERIES.values():
            yield CounterMetricFamily(series, doc, labels=[
                "name", "hostname", *(["reason"] if with_reason else [])])
        yield GaugeMetricFamily("celery_singleton_locks_held", "Locks held now",
                                labels=["name", "hostname"])
        yield _hold_histogram([])

    def collect(self) -> Iterator[Metric]:
        counts = monitor.read_counts(self.client, self.prefix)
        held = monitor.read_held(self.client, self.prefix)
        for counter, (series, doc, with_reason) in SERIES.items():
            labels = ["name", "hostname", *(["reason"] if with_reason else [])]
            family = CounterMetricFamily(series, doc, labels=labels)
            for name, task, host, reason, value in counts:
                if name == counter:
                    family.add_metric([task, host, *([reason] if with_reason else [])], value)
            yield family
        gauge = GaugeMetricFamily("celery_singleton_locks_held", "Locks held now",
                                  labels=["name", "hostname"])
        per_task: dict[tuple[str, str], int] = {}
        for lock in held:
            label = (lock["task"], lock["hostname"])
            per_task[label] = per_task.get(label, 0) + 1
        for (task, host), number in sorted(per_task.items()):
            gauge.add_metric([task, host], number)
        yield gauge
        yield _hold_histogram(counts)


def _hold_histogram(counts: list[tuple[str, str, str, str, float]]) -> Metric:
    family = HistogramMetricFamily("celery_singleton_hold_seconds",
                                   "How long locks were held", labels=["name", "hostname"])
    buckets: dict[tuple[str, str], dict[str, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    for name, task, host, reason, value in counts:
        if name == "hold_bucket":
            buckets.setdefault((task, host), {})[reason] = value
        elif name == "hold_sum":
            sums[(task, host)] = value
    for label, per_bound in sorted(buckets.items()):
        cumulative, rows = 0.0, []
        for bound in monitor.HOLD_BUCKETS:
            text = monitor._bound(bound)
            cumulative += per_bound.get(text, 0.0)
            rows.append((text, cumulative))
        family.add_metric(list(label), rows, sum_value=sums.get(label, 0.0))
    return family


def register(source: Union[str, Any], prefix: str = "singleton:",
             registry: Optional[CollectorRegistry] = None) -> SingletonCollector:
    """Add the lock series to ``registry`` (prometheus_client's default, the
    one Flower's ``/metrics`` serves). ``source``: the lock Redis URL
    (``singleton_redis_url``) or a Celery app."""
    collector = (SingletonCollector.from_url(source, prefix) if isinstance(source, str)
                 else SingletonCollector.from_app(source))
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
