"""Passwords of the lock Redis never printed: in the URL's user part, in its
query string (``?password=``, as docs/operating.md promises), in the client
options, in Celery's printed configuration and in error messages (no servers)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from celery_singleton_lock.observe import masking
from celery_singleton_lock.observe.masking import MASK, mask_options, mask_settings, mask_url, scrub

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

SECRET = "s3cret-Pw"


@pytest.mark.parametrize("url,shown", [
    (f"redis://:{SECRET}@h:6379/2", f"redis://:{MASK}@h:6379/2"),
    (f"redis://locks:{SECRET}@h:6379/2", f"redis://locks:{MASK}@h:6379/2"),
    # a password alone before the @ is a password in redis-py, not a user name
    (f"redis://{SECRET}@h/0", f"redis://:{MASK}@h/0"),
    (f"rediss://u:{SECRET}@h:6380/0?ssl_cert_reqs=required",
     f"rediss://u:{MASK}@h:6380/0?ssl_cert_reqs=required"),
    (f"redis://h:6379/0?password={SECRET}", f"redis://h:6379/0?password={MASK}"),
    (f"redis://h:6379/0?db=2&password={SECRET}&socket_timeout=5",
     f"redis://h:6379/0?db=2&password={MASK}&socket_timeout=5"),
    (f"sentinel://h:26379/0?sentinel_password={SECRET}&auth_token={SECRET}#x",
     f"sentinel://h:26379/0?sentinel_password={MASK}&auth_token={MASK}#x"),
    (f"redis://u:{SECRET}@h/0?password={SECRET}", f"redis://u:{MASK}@h/0?password={MASK}"),
    # a password holding ':' or '@' is hidden whole, and the user stays the user
    ("redis://locks:pa:ss@w@h:6379/2", f"redis://locks:{MASK}@h:6379/2"),
    # a blank value is kept as given (and a blank password is masked all the same)
    ("redis://h/0?password=&db=2&client_name=", f"redis://h/0?password={MASK}&db=2&client_name="),
], ids=["password", "user-and-password", "password-alone", "tls", "query", "query-among-others",
        "query-secret-names", "both", "colon-and-at-in-password", "blank-values"])
def test_a_url_is_shown_with_every_password_masked_and_the_rest_as_given(url, shown):
    assert mask_url(url) == shown
    assert SECRET not in mask_url(url)


@pytest.mark.parametrize("url", ["redis://h:6379/0", "redis://h:6379/0?db=2&socket_timeout=5",
                                 "unix:///run/redis.sock?db=2", "no url at all", ""])
def test_a_url_without_a_password_is_shown_unchanged(url):
    assert mask_url(url) == url


def test_an_unparsable_url_is_not_shown_at_all():
    """Fails closed: what cannot be parsed may hold a password anywhere."""
    assert mask_url(f"redis://:{SECRET}@[::1/0") == "redis://<unparsable url hidden>"
    assert mask_url(f"redis://[::1/0?next=rediss://:{SECRET}@h") == (
        "redis://<unparsable url hidden>")


def test_options_mask_secret_names_nested_mappings_and_urls():
    options: dict[Any, Any] = {
        "password": SECRET, "Sentinel_Password": SECRET, "ssl_keyfile_passphrase": SECRET,
        "auth_token": SECRET, "credential_provider": SECRET, "client_secret": SECRET,
        "sentinel_kwargs": {"passwd": SECRET, "socket_timeout": 1},
        "url": f"redis://h/0?password={SECRET}",
        "username": "locks", "socket_timeout": 2.5, "password_unset": None, 7: "seven",
    }
    masked = mask_options(options)
    assert SECRET not in str(masked)
    assert masked == {
        "password": MASK, "Sentinel_Password": MASK, "ssl_keyfile_passphrase": MASK,
        "auth_token": MASK, "credential_provider": MASK, "client_secret": MASK,
        "sentinel_kwargs": {"passwd": MASK, "socket_timeout": 1},
        "url": f"redis://h/0?password={MASK}",
        # no secret there: shown as given (a None is not a secret)
        "username": "locks", "socket_timeout": 2.5, "password_unset": None, 7: "seven",
    }
    assert options["password"] == SECRET, "the settings themselves are left alone"


def test_settings_mask_our_url_and_options_in_any_spelling_and_nothing_else():
    conf = {
        "singleton_redis_url": f"redis://:{SECRET}@h/2",
        "CELERY_SINGLETON_REDIS_URL": f"redis://h/2?password={SECRET}",
        "singleton_redis_options": {"password": SECRET},
        "SINGLETON_REDIS_OPTIONS": {"password": SECRET},
        # Celery's own rules handle these: given back untouched
        "broker_url": f"redis://:{SECRET}@h/0",
        "singleton_ttl": 30,
        "singleton_redis_url_note": f"redis://:{SECRET}@h/2",
        "other_options": {"password": SECRET},
        "singleton_redis_options_list": [SECRET],
    }
    masked = mask_settings(conf)
    assert masked["singleton_redis_url"] == f"redis://:{MASK}@h/2"
    assert masked["CELERY_SINGLETON_REDIS_URL"] == f"redis://h/2?password={MASK}"
    assert masked["singleton_redis_options"] == {"password": MASK}
    assert masked["SINGLETON_REDIS_OPTIONS"] == {"password": MASK}
    for name in ("broker_url", "singleton_ttl", "singleton_redis_url_note", "other_options",
                 "singleton_redis_options_list"):
        assert masked[name] == conf[name], name


def test_a_url_setting_that_is_not_a_string_is_left_to_celery():
    conf = {"singleton_redis_url": None, "singleton_redis_options": "not a mapping"}
    assert mask_settings(conf) == conf


def test_install_wraps_celerys_filter_once_and_masks_what_it_prints(monkeypatch):
    from celery.app import utils

    # an app of another test (SingletonTask.bind) may have installed it: start
    # from Celery's own filter
    original = utils.filter_hidden_settings
    original = getattr(original, "__wrapped__", original)
    monkeypatch.setattr(utils, "filter_hidden_settings", original)
    assert not masking.installed()
    masking.install()
    wrapped = utils.filter_hidden_settings
    assert masking.installed() and wrapped is not original
    assert wrapped.__doc__ == original.__doc__
    assert inspect.unwrap(wrapped) is original, "the wrapper says what it wraps"
    masking.install()
    assert utils.filter_hidden_settings is wrapped, "a second install wraps nothing more"
    shown = wrapped({"singleton_redis_url": f"redis://h/2?password={SECRET}",
                     "singleton_redis_options": {"password": SECRET},
                     "broker_url": f"redis://:{SECRET}@h/0", "database_password": SECRET})
    assert SECRET not in str(shown)
    assert shown["singleton_redis_url"] == f"redis://h/2?password={MASK}"


@pytest.mark.parametrize("text,shown", [
    (f"Error connecting to redis://:{SECRET}@h:6379/2.",
     f"Error connecting to redis://:{MASK}@h:6379/2."),
    (f"bad url redis://locks:{SECRET}@h/2 given", f"bad url redis://locks:{MASK}@h/2 given"),
    (f"Error connecting to redis://h:6379/2?password={SECRET}",
     f"Error connecting to redis://h:6379/2?password={MASK}"),
    (f"bad url redis://h/2?db=1&Sentinel_Password={SECRET}&x=1 given",
     f"bad url redis://h/2?db=1&Sentinel_Password={MASK}&x=1 given"),
    ("Connection refused by h:6379", "Connection refused by h:6379"),
], ids=["userinfo", "user-and-password", "query", "query-among-others", "no-url"])
def test_scrub_masks_a_url_password_quoted_in_a_message(text, shown):
    assert scrub(text) == shown
