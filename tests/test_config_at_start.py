"""Bad settings stop the worker at start with a message naming the setting."""

from __future__ import annotations

import uuid
from typing import Any, Optional

import pytest

from tests.support import RedisServer, Worker


def run_worker(redis_server: RedisServer, conf: dict[str, Any],
               env: Optional[dict[str, str]] = None) -> tuple[int, str]:
    w = Worker(redis_server.url(), f"cfg-{uuid.uuid4().hex[:6]}", pool="solo", conf=conf)
    w.env.update(env or {})
    w.start(wait=False)
    assert w.proc is not None
    try:
        code = w.proc.wait(30)
        out = w.output()
    finally:
        w.stop()
    return code, out


@pytest.mark.worker
@pytest.mark.parametrize("conf,env,setting", [
    ({"singleton_on_duplicate": "bogus"}, None, "singleton_on_duplicate"),
    ({"singleton_ttl": 0}, None, "singleton_ttl"),
    ({"broker_url": "amqp://guest:guest@127.0.0.1:1//", "singleton_redis_url": None}, None,
     "singleton_redis_url"),
    ({}, {"SLT_BAD_TASK_TTL": "-1"}, "singleton_ttl"),
    ({"singleton_scope": "until_done"}, None, "singleton_scope"),
])
def test_worker_refuses_to_start(redis_server, conf, env, setting):
    code, output = run_worker(redis_server, conf, env)
    assert code != 0
    assert f"celery-singleton-lock configuration error: {setting}:" in output
