"""A wait timed on one clock: the lock Redis's.

A duplicate under ``retry`` (and a redelivered copy, a call waiting for the
lock Redis, a throttle window) is sent again with a countdown. Celery writes
a countdown as an ETA on the sender's clock, and the worker that reads the
message times the ETA on its own: behind a sender 30 s ahead, a 2 s wait took
32 s, and the other way round, none. Each such message now carries how far
its sender's clock was from the lock Redis's (``singleton_clock``), and the
worker that reads it moves the ETA by the difference of the two offsets.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any

import pytest
from kombu import Connection

from celery_singleton_lock.conflict.outcomes import CLOCK_HEADER
from celery_singleton_lock.testing import hold_key
from celery_singleton_lock.worker.step import SingletonRequest, clock_offset_of
from tests.support import Worker, discard, missing, wait_for
from tests.workerapp import make_app

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
#: the sender's clock, this far ahead of the lock Redis's
AHEAD = 30.0


@pytest.mark.worker
def test_a_wait_sent_from_a_host_whose_clock_is_ahead_says_how_far(redis_server, events):
    """A worker whose clock is 30 s ahead (libfaketime) sends a duplicate under
    ``retry`` again while its key is held: each message it sends carries its
    offset from the lock Redis's clock, about -30 s, which the run that comes
    once the key is free can read."""
    if not os.path.exists(LIBFAKETIME):
        missing("libfaketime (apt-get install faketime)")
    queue = f"clock-{uuid.uuid4().hex[:8]}"
    conf = {"singleton_retry_delay": 0.3, "singleton_retry_max_delay": 0.6}
    worker = Worker(redis_server.url(), queue, concurrency=1, conf=conf, name="ahead")
    worker.env.update(LD_PRELOAD=LIBFAKETIME, FAKETIME=f"+{AHEAD:g}s",
                      FAKETIME_DONT_FAKE_MONOTONIC="1")
    worker.start()
    try:
        app = make_app(redis_server.url(), queue, conf=conf)
        task = app.tasks["t.hold_retry"]
        key = uuid.uuid4().hex[:8]
        with hold_key(task, key):
            result = task.delay(key, 0.0, "waits")
            wait_for(lambda: worker.logs().count("] waits: ") >= 2, 30,
                     what="the duplicate sent again twice")
        assert result.get(timeout=30)["tag"] == "waits"
        start = next(e for e in events.starts("waits"))
        assert start["retries"] == 0  # waited: sent again, not retried
        sent = start["clock"]
        assert sent is not None and abs(sent + AHEAD) < 2.0, start
    finally:
        discard(worker)


def test_a_worker_times_such_a_wait_on_the_lock_redis_clock(redis_server):
    """The message a sender 30 s ahead wrote (its ETA 30 s later than the lock
    Redis's clock says): the worker that reads it (its own clock right)
    moves the ETA back by those 30 s; a message without the header, or from
    a sender whose clock is right, keeps its ETA."""
    queue = f"clock-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server.url(), queue)
    task = app.tasks["t.hold_retry"]
    mine = clock_offset_of(app)
    assert mine is not None and abs(mine) < 2.0

    def received(headers: dict[str, Any]) -> SingletonRequest:
        task.apply_async(("k",), countdown=2, headers=headers, queue=queue)
        with Connection(app.conf.broker_url) as conn:
            message = conn.SimpleQueue(queue).get(timeout=10)
            message.ack()  # else the queue gets it back when the connection closes
            return SingletonRequest(message, app=app, task=task)

    plain = received({})
    ahead = received({CLOCK_HEADER: -AHEAD})
    right = received({CLOCK_HEADER: mine})
    raw_ahead = super(SingletonRequest, ahead).eta
    assert plain.eta == super(SingletonRequest, plain).eta
    assert abs((raw_ahead - ahead.eta) - timedelta(seconds=AHEAD + mine)) < timedelta(
        milliseconds=1)
    assert abs(right.eta - super(SingletonRequest, right).eta) < timedelta(milliseconds=1)
