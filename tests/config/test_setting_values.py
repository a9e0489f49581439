"""Each setting's value as the user writes it: what is kept, and every refusal
word for word (no servers)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_singleton_lock import ConfigurationError
from celery_singleton_lock.config import check_also_lock

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def refusal(call: Any, *args: Any) -> str:
    with pytest.raises(ConfigurationError) as info:
        call(*args)
    return str(info.value)


# -- singleton_also_lock ------------------------------------------------------------------

ONCE = {"library": "celery_once"}


@pytest.mark.parametrize("value,message", [
    ("celery-once", "unknown library 'celery-once'; expected one of: celery_singleton, "
                    "celery_once"),
    ({}, "unknown library None; expected one of: celery_singleton, celery_once"),
    ({**ONCE, "zz": 1, "ttl": 3}, "unknown field 'ttl', 'zz'; expected some of: library, url, "
                                  "key_prefix, expiry, keys"),
    ({**ONCE, "url": "http://x"}, "url: expected a redis://, rediss:// or unix:// URL (where "
                                  "the old library keeps its locks), got 'http://x'"),
    ({**ONCE, "url": 5}, "url: expected a redis://, rediss:// or unix:// URL (where the old "
                         "library keeps its locks), got 5"),
    ({**ONCE, "expiry": 0}, "expiry: expected seconds > 0 or None (never), got 0"),
    ({**ONCE, "expiry": -1.5}, "expiry: expected seconds > 0 or None (never), got -1.5"),
    ({**ONCE, "expiry": True}, "expiry: expected seconds > 0 or None (never), got True"),
    ({**ONCE, "expiry": "5"}, "expiry: expected seconds > 0 or None (never), got '5'"),
    ({**ONCE, "keys": []}, "keys: expected argument names, got []"),
    ({**ONCE, "keys": ["a", 1]}, "keys: expected argument names, got ['a', 1]"),
    ({**ONCE, "keys": 5}, "keys: expected argument names, got 5"),
    ({**ONCE, "key_prefix": 5}, "key_prefix: expected a string, got 5"),
    (3, "expected 'celery_singleton', 'celery_once' or a dict with 'library', got 3"),
    (None, "expected 'celery_singleton', 'celery_once' or a dict with 'library', got None"),
])
def test_a_bad_also_lock_is_refused_saying_what_is_wrong(value: Any, message: str) -> None:
    assert refusal(check_also_lock, "singleton_also_lock", value) == (
        f"singleton_also_lock: {message}")


def test_an_also_lock_is_kept_as_a_dict_with_its_keys_a_tuple() -> None:
    assert check_also_lock("singleton_also_lock", "celery_once") == {"library": "celery_once"}
    assert check_also_lock("singleton_also_lock", "celery_singleton") == {
        "library": "celery_singleton"}
    spec = {"library": "celery_singleton", "url": "unix:///run/redis.sock", "key_prefix": "p:",
            "expiry": 0.5, "keys": "account_id"}
    kept = check_also_lock("singleton_also_lock", spec)
    assert kept == {**spec, "keys": ("account_id",)}
    assert spec["keys"] == "account_id", "the user's dict is not changed"
    for url in ("redis://h:1/4", "rediss://h:1/4"):
        assert check_also_lock("s", {**ONCE, "url": url, "expiry": None, "keys": None,
                                     "key_prefix": None})["url"] == url
    assert check_also_lock("s", {**ONCE, "keys": ["a", "b"], "expiry": 3})["keys"] == ("a", "b")
