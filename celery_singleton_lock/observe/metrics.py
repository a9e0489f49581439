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

import time
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

    def __init__(self, engine: Any, prefix: str = "singleton:") -> None:
        #: the lock engine the counts and the held locks are read through
        self.engine = engine
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "singleton:",
                 **options: Any) -> SingletonCollector:
        from ..config import SingletonConfig
        from ..engine.registry import connect

        return cls(connect(SingletonConfig.defaults(url, key_prefix=prefix,
                                                    redis_options=options)), prefix)

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
        yield _histogram([], *HISTOGRAMS["hold"])
        yield _histogram([], *HISTOGRAMS["acquire"])
        yield from _health(None)

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        try:
            counts = monitor.read_counts(self.engine, self.prefix)
            held = monitor.read_held(self.engine, self.prefix)
        except redis.RedisError:
            # the lock Redis's health is a series too: a scrape still answers
            yield from _health(None)
            return
        yield from _health(time.monotonic() - started)
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
        yield _histogram(counts, *HISTOGRAMS["hold"])
        yield _histogram(counts, *HISTOGRAMS["acquire"])


#: histogram -> (series, help, upper bounds)
HISTOGRAMS: dict[str, tuple[str, str, str, tuple[float, ...]]] = {
    "hold": ("hold", "celery_singleton_hold_seconds", "How long locks were held",
             monitor.HOLD_BUCKETS),
    "acquire": ("acquire", "celery_singleton_acquire_seconds",
                "How long an execution waited for its lock's answer (granted or refused)",
                monitor.ACQUIRE_BUCKETS),
}


def _health(seconds: Optional[float]) -> Iterator[Metric]:
    """Whether the lock Redis answered this scrape, and how fast (PING and the
    two reads of the counters and held locks)."""
    up = GaugeMetricFamily("celery_singleton_redis_up",
                           "1 when the lock Redis answered this scrape, else 0")
    latency = GaugeMetricFamily("celery_singleton_redis_scrape_seconds",
                                "Seconds the lock Redis took to answer this scrape")
    if seconds is not None:
        up.add_metric([], 1.0)
        latency.add_metric([], seconds)
    else:
        up.add_metric([], 0.0)
    yield up
    yield latency


def _histogram(counts: list[tuple[str, str, str, str, float]], histogram: str, series: str,
               doc: str, bounds: tuple[float, ...]) -> Metric:
    family = HistogramMetricFamily(series, doc, labels=["name", "hostname"])
    buckets: dict[tuple[str, str], dict[str, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    for name, task, host, reason, value in counts:
        if name == f"{histogram}_bucket":
            buckets.setdefault((task, host), {})[reason] = value
        elif name == f"{histogram}_sum":
            sums[(task, host)] = value
    for label, per_bound in sorted(buckets.items()):
        cumulative, rows = 0.0, []
        for bound in bounds:
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
