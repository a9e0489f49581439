"""Bad settings stop the worker at start with a message naming the setting; good
ones are named in its start-up line."""

from __future__ import annotations

import uuid
from typing import Any, Optional

import pytest

from tests.support import NotRedis, RedisServer, Worker, wait_for


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


@pytest.mark.worker
def test_a_misspelt_setting_stops_the_worker_with_the_name_it_meant(redis_server):
    code, output = run_worker(redis_server, {"singleton_on_duplicates": "retry"})
    assert code != 0
    assert ("configuration error: singleton_on_duplicates: unknown setting; did you mean "
            "singleton_on_duplicate?") in output


@pytest.mark.worker
def test_a_misspelt_task_option_stops_the_worker_naming_task_option_and_suggestion(
        redis_server):
    code, output = run_worker(redis_server, {}, {"SLT_TASK_OPTIONS": '{"singleton_tll": 5}'})
    assert code != 0
    assert ("configuration error: singleton_tll: task 't.options': unknown task option; "
            "did you mean singleton_ttl?") in output


@pytest.mark.worker
def test_celery_singletons_settings_are_named_with_ours_not_refused(redis_server):
    """A migration keeps celery-singleton's settings for a while: the worker starts
    and its log names each one and what replaces it here."""
    w = Worker(redis_server.url(), f"cfg-{uuid.uuid4().hex[:6]}", pool="solo", conf={
        "singleton_backend_url": redis_server.url(5), "singleton_lock_expiry": 60,
        "singleton_raise_on_duplicate": True},
        ).start()
    try:
        log = w.logs()
    finally:
        w.stop()
    for theirs, ours in [("singleton_backend_url", "singleton_redis_url"),
                         ("singleton_lock_expiry", "singleton_ttl"),
                         ("singleton_raise_on_duplicate", 'singleton_on_duplicate="raise"')]:
        assert f"the setting {theirs} belongs to celery-singleton and is not read here; use " \
               f"{ours}" in log


@pytest.mark.worker
def test_the_start_up_line_names_the_masked_lock_url_and_the_mode(redis_server):
    """The worker says where its locks live, as a standalone Redis, with the
    password masked: never the password itself."""
    locks = RedisServer(["--requirepass", "lock-pw-4321"]).start()
    w = Worker(redis_server.url(), f"cfg-{uuid.uuid4().hex[:6]}", pool="solo",
               lock_url=f"redis://:lock-pw-4321@127.0.0.1:{locks.port}/2")
    try:
        w.start()
        line = wait_for(lambda: [ln for ln in w.logs().splitlines() if "locks in" in ln], 10,
                        what="start-up line")[0]
        log = w.logs()
    finally:
        w.stop()
        locks.cleanup()
    assert f"redis://:********@127.0.0.1:{locks.port}/2 (standalone)" in line
    assert "lock-pw-4321" not in log


@pytest.mark.worker
def test_a_lock_url_at_a_server_that_is_not_redis_stops_the_worker_in_one_line(redis_server):
    """Something answers at the lock URL, in another protocol (an HTTP server):
    the worker stops at start saying so and what to fix, with no traceback."""
    other = NotRedis()
    try:
        code, output = run_worker(redis_server, {"singleton_redis_url": other.url(2)})
    finally:
        other.close()
    assert code != 0
    assert (f"celery-singleton-lock configuration error: singleton_redis_url: lock Redis at "
            f"{other.url(2)} answers, but not as Redis does: it said \"HTTP/1.1 400 Bad "
            "Request\"") in output
    assert "point singleton_redis_url at the Redis host and port" in output
    assert "Traceback" not in output and "InvalidResponse" not in output
