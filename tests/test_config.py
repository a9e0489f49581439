"""Bad settings stop the worker at start with a message naming the setting."""

from __future__ import annotations

import uuid
from typing import Any, Optional

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, SingletonTask, get_config
from celery_singleton_lock.bootsteps import validate_app
from tests.support import RedisServer, Worker


def app_with(**conf: Any) -> Celery:
    app = Celery("cfg", broker=conf.pop("broker", "redis://127.0.0.1:1/0"),
                 set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize("setting,value,message", [
    ("singleton_on_duplicate", "ignore", "unknown policy 'ignore'; expected one of: skip, retry"),
    ("singleton_on_backend_error", "drop", "expected one of: retry, run, raise"),
    ("singleton_ttl", 0, "must be greater than 0"),
    ("singleton_ttl", -5, "must be greater than 0"),
    ("singleton_ttl", "30", "expected a number of seconds"),
    ("singleton_redis_url", "http://x", "expected a redis://"),
    ("singleton_scope", "forever", "unknown scope 'forever'; expected one of: run, queue"),
    ("singleton_done_ttl", -1, "must be greater than 0"),
    ("singleton_done_ttl", "1h", "expected a number of seconds"),
    ("singleton_queue_ttl", 0, "must be greater than 0"),
])
def test_bad_setting_names_itself(setting, value, message):
    with pytest.raises(ConfigurationError) as info:
        get_config(app_with(**{setting: value}))
    assert info.value.setting == setting
    assert str(info.value).startswith(f"{setting}: ")
    assert message in str(info.value)


def test_redis_url_defaults_to_a_redis_broker():
    assert get_config(app_with(broker="redis://h:1/3")).redis_url == "redis://h:1/3"


def test_non_redis_broker_needs_singleton_redis_url():
    with pytest.raises(ConfigurationError, match="singleton_redis_url: not set, and the broker"):
        get_config(app_with(broker="amqp://guest@localhost//"))
    cfg = get_config(app_with(broker="amqp://x//", singleton_redis_url="redis://h/1"))
    assert cfg.redis_url == "redis://h/1"


def test_bad_task_option_names_task_and_option():
    app = app_with()

    @app.task(base=SingletonTask, name="shop.refund", singleton_on_duplicate="later",
              shared=False)
    def refund(order_id: int) -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        validate_app(app)
    assert info.value.setting == "singleton_on_duplicate"
    assert "task 'shop.refund'" in str(info.value)


def test_bad_task_scope_names_task_and_option():
    app = app_with()

    @app.task(base=SingletonTask, name="shop.report", singleton_scope="queued", shared=False)
    def report(day: str) -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        validate_app(app)
    assert info.value.setting == "singleton_scope"
    assert "task 'shop.report'" in str(info.value)
    assert "expected one of: run, queue, queue_and_run" in str(info.value)


def test_scope_settings_are_read_with_defaults():
    cfg = get_config(app_with())
    assert (cfg.scope, cfg.done_ttl, cfg.queue_ttl) == ("run", 0.0, 300.0)
    cfg = get_config(app_with(singleton_scope="queue_and_run", singleton_done_ttl=3600,
                              singleton_queue_ttl=60))
    assert (cfg.scope, cfg.done_ttl, cfg.queue_ttl) == ("queue_and_run", 3600.0, 60.0)


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
