"""A cold shutdown never loses an acks_late task: its redelivery runs.

Celery records no outcome for a body interrupted by ``SystemExit`` (a cold
shutdown, SIGQUIT after SIGTERM) and kombu puts the unacknowledged message
back. The release in the task's ``finally`` must then free the key without
marking the task id finished, or the redelivery is dropped as "already
finished" and the task stays PENDING for good.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest

from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

CONF = {"singleton_ttl": 30.0}


@pytest.mark.parametrize("round_", [1, 2])
def test_a_cold_shutdown_loses_no_acks_late_task(redis_server: RedisServer, r: Any,
                                                 events: Any, round_: int) -> None:
    queue = f"cold-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server.url(), queue, conf=CONF)
    first = Worker(redis_server.url(), queue, concurrency=2, conf=CONF).start()
    try:
        task = app.tasks["t.hold_late"]
        keys = [uuid.uuid4().hex[:8] for _ in range(2)]
        sent = [task.delay(k, 10.0, f"cold{round_}-{i}") for i, k in enumerate(keys)]
        wait_for(lambda: len(events.starts(f"cold{round_}-")) == 2, 20,
                 what="both tasks running")
        first.signal(signal.SIGTERM)  # warm shutdown: the bodies go on running
        time.sleep(1.0)  # the operator's patience; nothing here races a lease
        assert len(events.ends(f"cold{round_}-")) == 0
        first.signal(signal.SIGQUIT)  # cold: each body gets SystemExit
        assert first.proc is not None
        first.proc.wait(30)
    finally:
        first.stop()
    # the interrupted bodies freed their keys and left no "finished" trace
    for k in keys:
        lock_keys = task.singleton_keys(k)
        assert not r.exists(lock_keys.lock)
        assert not r.exists(lock_keys.fin)
    second = Worker(redis_server.url(), queue, concurrency=2, conf=CONF).start()
    try:
        wait_for(lambda: len(events.starts(f"cold{round_}-")) == 4, 60,
                 what="both redeliveries running")
        for k in keys:  # the bodies' 10 s were for the shutdown; end the reruns now
            events.client.set(f"finish:{k}", 1)
        for i, res in enumerate(sent):
            assert res.get(timeout=60)["tag"] == f"cold{round_}-{i}"
        assert "already finished" not in second.logs()
        for i, res in enumerate(sent):
            runs = [e for e in events.starts(f"cold{round_}-{i}") if e["id"] == res.id]
            assert len(runs) == 2, runs  # interrupted once, then run to the end
    finally:
        discard(second)
