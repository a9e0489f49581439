"""Settings as the user reads about them: every refusal's exact text, the
warning for celery-singleton's settings, the lock URL taken from the broker,
and the settings read once per app (no servers)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, SingletonConfig, get_config
from celery_singleton_lock.config import (
    check_rate,
    check_task_names,
    check_together,
    check_url,
    choice,
)

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def app_with(broker: Any = "redis://127.0.0.1:1/0", **conf: Any) -> Celery:
    app = Celery("names", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


def namespaced(namespace: str, **settings: Any) -> Celery:
    app = Celery("names", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.config_from_object(type("Settings", (), settings), namespace=namespace)
    return app


def refusal(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigurationError) as info:
        call(*args, **kwargs)
    return str(info.value)


# -- celery-singleton's settings: named in a warning, once, the rest still checked ------

def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "celery_singleton_lock" and r.levelno == logging.WARNING]


def fresh_namespace() -> str:
    """A namespace no app of this process used: a name is warned about once per process."""
    return f"NS{uuid.uuid4().hex[:12].upper()}"


def test_each_celery_singleton_setting_is_named_once_with_what_replaces_it(caplog):
    ns = fresh_namespace()
    app = namespaced(ns, **{f"{ns}_SINGLETON_BACKEND_URL": "redis://h/1",
                            f"{ns}_SINGLETON_LOCK_EXPIRY": 60})
    with caplog.at_level(logging.WARNING, logger="celery_singleton_lock"):
        get_config(app)
        get_config(app, reload=True)  # read again: no second warning
    assert warnings_in(caplog) == [
        f"celery-singleton-lock: the setting {ns}_SINGLETON_BACKEND_URL belongs to "
        "celery-singleton and is not read here; use singleton_redis_url",
        f"celery-singleton-lock: the setting {ns}_SINGLETON_LOCK_EXPIRY belongs to "
        "celery-singleton and is not read here; use singleton_ttl (a lease renewed while "
        "the task runs)",
    ]


def test_a_misspelt_setting_beside_a_celery_singleton_one_is_still_refused():
    ns = fresh_namespace()
    settings = {f"{ns}_SINGLETON_BACKEND_URL": "redis://h/1", f"{ns}_SINGLETON_TTX": 5}
    expected = f"{ns}_SINGLETON_TTX: unknown setting; did you mean {ns}_SINGLETON_TTL?"
    # warned about for the first time, then the next name is checked
    assert refusal(get_config, namespaced(ns, **settings)) == expected
    # warned about already (another app of the process): the next name is checked too
    assert refusal(get_config, namespaced(ns, **settings)) == expected


def test_a_misspelt_setting_after_a_known_one_is_refused():
    assert refusal(get_config, app_with(singleton_ttl=5, singleton_ttx=5)) == (
        "singleton_ttx: unknown setting; did you mean singleton_ttl?")


def test_a_setting_far_from_every_name_points_at_the_settings_page():
    assert refusal(get_config, app_with(singleton_qqqqqqqqqq=1)) == (
        "singleton_qqqqqqqqqq: unknown setting (docs/settings.md)")


def test_a_setting_whose_name_is_no_string_does_not_stop_the_check():
    app = app_with()
    app.conf.update({0: "x", "singleton_ttx": 5})
    assert refusal(get_config, app).startswith("singleton_ttx: unknown setting")


def test_under_a_namespace_a_misspelt_setting_written_without_it_is_refused_too():
    app = namespaced("CELERY", CELERY_SINGLETON_TTL=5)
    app.conf.update(singleton_ttx=5)
    assert refusal(get_config, app).startswith("singleton_ttx: unknown setting")


# -- task options -------------------------------------------------------------------------

def test_an_app_setting_given_as_a_task_option_says_where_it_goes():
    assert refusal(check_task_names, "t.x", {"singleton_redis_url": "redis://h/0"}) == (
        "singleton_redis_url: task 't.x': an app setting, not a task option: set it in app.conf")


def test_a_task_option_far_from_every_name_points_at_the_settings_page():
    assert refusal(check_task_names, "t.x", {"singleton_qqqqqqqqqq": 1}) == (
        "singleton_qqqqqqqqqq: task 't.x': unknown task option (docs/settings.md)")


ONCE = ("once: task 't.x': an option of celery-once, which celery-singleton-lock does not "
        "read; use singleton_scope='queue_and_run' (the key taken at send, as celery-once did), ")


@pytest.mark.parametrize("value,replacement", [
    (True, "singleton_on_duplicate='raise'"),
    ({}, "singleton_on_duplicate='raise'"),
    ({"graceful": True}, "singleton_on_duplicate='skip'"),
    ({"graceful": False, "timeout": 60},
     "singleton_on_duplicate='raise', singleton_ttl (a lease renewed while the task runs, "
     "not the longest a run may take)"),
    ({"graceful": True, "timeout": 0},
     "singleton_on_duplicate='skip', singleton_ttl (a lease renewed while the task runs, "
     "not the longest a run may take)"),
])
def test_celery_onces_option_is_refused_naming_every_setting_that_replaces_it(value, replacement):
    assert refusal(check_task_names, "t.x", {"once": value}) == (
        f"{ONCE}{replacement} (docs/migration.md)")


# -- values -------------------------------------------------------------------------------

def test_a_choice_says_policy_unless_told_what_its_values_are():
    assert refusal(choice(("a", "b")), "singleton_x", "c") == (
        "singleton_x: unknown policy 'c'; expected one of: a, b")


def test_a_window_under_a_second_is_kept():
    config = SingletonConfig.defaults("redis://h/0").for_task(
        "t.x", {"singleton_done_ttl": 0.5, "singleton_throttle": 0.25})
    assert (config.done_ttl, config.throttle) == (0.5, 0.25)


def test_a_rate_is_kept_without_its_spaces_and_a_bad_one_is_refused_saying_the_form():
    assert check_rate("singleton_rate", " 10/m ") == "10/m"
    assert check_rate("singleton_rate", "100/30s") == "100/30s"
    assert refusal(check_rate, "singleton_rate", "10 per minute") == (
        "singleton_rate: expected '<starts>/<window>' such as '10/m', '100/30s' or '5/2h' "
        "(at most that many starts of one key in any such window, across every worker), "
        "got '10 per minute'")


def test_a_bad_deployment_url_is_named_by_its_hosts_without_the_password():
    text = refusal(check_url, "singleton_redis_url", "sentinel://user:s3cret@h1:26379")
    assert text == ("singleton_redis_url: no master name: sentinel://host:port/<master>[/<db>] "
                    "in 'h1:26379'")


# -- settings together: the app's or a task's ----------------------------------------------

def test_settings_wrong_together_name_the_task_only_when_a_task_set_them():
    app = app_with(singleton_limit=2, singleton_scope="queue")
    assert refusal(get_config, app) == (
        "singleton_limit: 2 per key goes with singleton_scope='run' only, without a throttle; "
        "not with singleton_scope='queue'")
    config = SingletonConfig.defaults("redis://h/0")
    assert refusal(config.for_task, "t.x", {"singleton_limit": 2, "singleton_scope": "queue"}) == (
        "singleton_limit: task 't.x': 2 per key goes with singleton_scope='run' only, without a "
        "throttle; not with singleton_scope='queue'")


def test_a_rate_goes_without_a_throttle_and_with_one_lock_redis():
    with_throttle = SingletonConfig.defaults("redis://h/0", rate="10/m", throttle=5.0)
    assert refusal(check_together, "", with_throttle) == (
        "singleton_rate: '10/m' with singleton_throttle: choose one (a throttle is a rate of one)")
    for scheme in ("redlock", "redlocks"):
        on_redlock = SingletonConfig.defaults(f"{scheme}://h1:1,h2:2,h3:3", rate="10/m")
        assert refusal(check_together, "t.x", on_redlock) == (
            "singleton_rate: task 't.x': '10/m' needs one lock Redis (a server, Sentinel or "
            "Cluster), not redlock://")


# -- the lock URL from the broker ------------------------------------------------------------

@pytest.mark.parametrize("broker,url", [
    ("redis://a:1/1", "redis://a:1/1"),
    ("redis://a:1/1; redis://b:2/2", "redis://a:1/1"),  # failover brokers: the first
    (["redis://a:1/1", "redis://b:2/2"], "redis://a:1/1"),
])
def test_the_lock_url_is_the_first_redis_broker(broker, url):
    assert get_config(app_with(broker=broker)).redis_url == url


@pytest.mark.parametrize("broker", ["amqp://guest@localhost//", [], ["amqp://h//"]])
def test_without_a_redis_broker_the_lock_url_must_be_set(broker):
    app = app_with()
    app.conf.broker_url = broker
    assert refusal(get_config, app) == (
        "singleton_redis_url: not set, and the broker is not Redis: set singleton_redis_url = "
        "'redis://host:6379/0'")


# -- read once per app ---------------------------------------------------------------------

def test_the_settings_are_read_once_per_app_until_reloaded():
    app = app_with(singleton_ttl=5)
    first = get_config(app)
    assert first.ttl == 5.0 and get_config(app) is first
    app.conf.singleton_ttl = 7
    assert get_config(app).ttl == 5.0, "a change after the first read counts on reload only"
    reloaded = get_config(app, reload=True)
    assert reloaded.ttl == 7.0 and reloaded is not first
    assert get_config(app) is reloaded
    assert get_config(app_with(singleton_ttl=5)) is not first, "each app has its own"
