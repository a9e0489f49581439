"""Settings: one table, each bad value named (no servers)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, SingletonTask, get_config
from celery_singleton_lock.worker.step import validate_app

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


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




def test_every_setting_comes_from_one_table_with_a_default_its_check_accepts():
    from celery_singleton_lock.config import SETTINGS, SingletonConfig

    fields = {f.name for f in dataclasses.fields(SingletonConfig)}
    assert fields == {s.field for s in SETTINGS}
    for s in SETTINGS:
        if s.default is not None:
            assert s.check(s.name, s.default) == s.default, s.name
    defaults = SingletonConfig.defaults("redis://h/0")
    assert defaults.ttl == 30.0 and defaults.on_duplicate == "skip" and defaults.scope == "run"


def test_task_options_override_only_per_task_settings_and_name_the_task():
    from celery_singleton_lock.config import TASK_OPTIONS, SingletonConfig

    assert {s.name for s in TASK_OPTIONS} == {"singleton_ttl", "singleton_on_duplicate",
                                              "singleton_scope", "singleton_done_ttl",
                                              "singleton_throttle", "singleton_rate",
                                              "singleton_limit", "singleton_debounce",
                                              "singleton_debounce_max", "singleton_also_lock"}
    app_level = SingletonConfig.defaults("redis://h/0", ttl=10.0)
    task_level = app_level.for_task("t.x", {"singleton_ttl": 2, "singleton_scope": None})
    assert (task_level.ttl, task_level.scope) == (2.0, "run")
    assert app_level.for_task("t.x", {}) is app_level
    with pytest.raises(ConfigurationError, match=r"singleton_ttl: task 't\.x': must be greater"):
        app_level.for_task("t.x", {"singleton_ttl": -1})


def test_every_setting_is_in_the_settings_page():
    from pathlib import Path

    from celery_singleton_lock.config import SETTINGS

    page = (Path(__file__).resolve().parents[2] / "docs" / "settings.md").read_text()
    missing = [s.name for s in SETTINGS if f"`{s.name}`" not in page]
    assert not missing, missing


def test_a_misspelt_setting_is_refused_at_first_use_in_the_form_it_was_written():
    class Settings:
        CELERY_SINGLETON_TLL = 5

    app = Celery(set_as_current=False, broker="redis://h/0")
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match=r"^CELERY_SINGLETON_TLL: unknown setting; "
                                                 r"did you mean CELERY_SINGLETON_TTL\?$"):
        get_config(app)
    far = Celery(set_as_current=False, broker="redis://h/0")
    far.conf.singleton_zzzz = 1
    with pytest.raises(ConfigurationError, match=r"^singleton_zzzz: unknown setting "):
        get_config(far)


def test_a_task_option_that_is_no_task_option_is_refused_at_first_use():
    app = Celery(set_as_current=False, broker="redis://h/0")

    @app.task(base=SingletonTask, name="t.typo", singleton_tll=5, shared=False)
    def typo() -> None:
        return None

    @app.task(base=SingletonTask, name="t.app_only", singleton_on_backend_error="run", shared=False)
    def app_only() -> None:
        return None

    with pytest.raises(ConfigurationError, match=r"^singleton_tll: task 't\.typo': unknown "
                                                 r"task option; did you mean singleton_ttl\?$"):
        typo.singleton_settings()
    with pytest.raises(ConfigurationError, match="an app setting, not a task option"):
        app_only.singleton_settings()


def test_reading_a_tasks_settings_binds_no_app_to_the_base_class():
    """Checking a task's option names must not touch Celery's class property
    ``app`` of SingletonTask itself: that binds the base class to the current
    app, and every task class made later inherits its serializer and the rest
    instead of reading its own app's settings."""
    first = Celery("first", broker="redis://h/0", set_as_current=False)

    @first.task(base=SingletonTask, name="first.t", shared=False)
    def one() -> None:
        return None

    one.singleton_settings()
    assert "_app" not in vars(SingletonTask) or vars(SingletonTask)["_app"] is None
    second = Celery("second", broker="redis://h/0", set_as_current=False)
    second.conf.task_serializer = "pickle"

    @second.task(base=SingletonTask, name="second.t", shared=False)
    def two() -> None:
        return None

    assert two.serializer == "pickle"


@pytest.mark.parametrize("option", ["singleton_done_ttl", "singleton_throttle",
                                    "singleton_debounce", "singleton_debounce_max"])
def test_a_window_option_says_0_and_none_mean_off_when_it_refuses_a_value(option):
    """0 and None turn these windows off (docs/settings.md); the message for a
    value refused says so, instead of "greater than 0" alone, which 0 is not."""
    app = app_with()

    @app.task(base=SingletonTask, name=f"t.{option}", shared=False, **{option: -3})
    def negative() -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        negative.singleton_settings()
    assert str(info.value) == (f"{option}: task 't.{option}': must be greater than 0, or 0 "
                               "or None for off, got -3")
    for off in (0, 0.0, None):
        app = app_with()

        @app.task(base=SingletonTask, name=f"t.off.{option}", shared=False, **{option: off})
        def quiet() -> None:
            return None

        assert getattr(quiet.singleton_settings().config, option[len("singleton_"):]) == 0


@pytest.mark.parametrize("options,setting", [
    ({"singleton_tll": 5}, "singleton_tll"),
    ({"singleton_limit": 0}, "singleton_limit"),
    ({"singleton_throttle": -1}, "singleton_throttle"),
])
def test_a_bad_task_option_stops_a_plain_call_as_it_stops_the_first_send(options, setting):
    """docs/settings.md: a bad task option stops "the first send or call" of the
    task outside a worker; a plain call ``task(...)`` is a call."""
    app = app_with()

    @app.task(base=SingletonTask, name="t.plain_call", shared=False, **options)
    def plain(x: str) -> str:
        return x

    with pytest.raises(ConfigurationError) as info:
        plain("x")
    assert info.value.setting == setting


def test_the_fencing_counter_outlives_its_lock_by_the_retention_or_a_tenth_of_the_lease():
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.calls import fence_ttl_ms

    assert SingletonConfig.defaults("redis://x").fence_ttl == 300.0
    assert fence_ttl_ms(30_000, 300_000) == 330_000
    assert fence_ttl_ms(3_600_000, 300_000) == 3_960_000  # a tenth of an hour's lease
    assert fence_ttl_ms(1_000, 1) == 1_100
