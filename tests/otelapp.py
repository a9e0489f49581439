"""The Celery app of the trace tests: ``tests.workerapp``'s tasks, traced by
``opentelemetry-instrumentation-celery`` into the SDK's in-memory exporter in
each pool process. After each task the finished spans are written, as JSON, to
db 3 list ``spans`` (name, attributes, events), where the test reads them.
Configured from the environment like ``tests.workerapp``."""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery, signals

from tests.workerapp import make_app, recorder


def make_otel_app(redis_url: str, queue: str, conf: dict[str, Any] | None = None) -> Celery:
    app = make_app(redis_url, queue, None, conf)
    rec = recorder(redis_url)
    exported: dict[str, Any] = {}

    @signals.worker_process_init.connect(weak=False)
    def tracing(**_: Any) -> None:  # in each pool process, as the instrumentation says
        from opentelemetry import trace
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        CeleryInstrumentor().instrument()
        exported["exporter"] = exporter
        # after the instrumentation's own: its span has ended by then
        signals.task_postrun.connect(publish, weak=False)

    def publish(**_: Any) -> None:
        exporter = exported["exporter"]
        for span in exporter.get_finished_spans():
            rec.rpush("spans", json.dumps({
                "name": span.name, "attributes": dict(span.attributes or {}),
                "events": [{"name": e.name, "attributes": dict(e.attributes or {})}
                           for e in span.events]}))
        exporter.clear()

    return app


def __getattr__(name: str) -> Celery:
    if name == "app":
        app = make_otel_app(os.environ.get("SLT_REDIS_URL", "redis://127.0.0.1:6379/0"),
                            os.environ.get("SLT_QUEUE", "celery"),
                            json.loads(os.environ.get("SLT_CONF") or "{}"))
        globals()["app"] = app
        return app
    raise AttributeError(name)
