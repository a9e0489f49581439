"""Settings fine alone and wrong together: each pair refused with the message
the user reads, naming the task, the setting and what to set (no servers); and
the slots of ``singleton_limit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from celery_singleton_lock import ConfigurationError, SingletonConfig
from celery_singleton_lock.config import check_together
from celery_singleton_lock.keys import LockKeys

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

BASE = SingletonConfig.defaults("redis://127.0.0.1:6379/0")


def refused(task: str = "t.x", **changes: Any) -> str:
    with pytest.raises(ConfigurationError) as info:
        check_together(task, dataclasses.replace(BASE, **changes))
    return str(info.value)


def test_a_limit_goes_with_scope_run_only_without_a_throttle():
    assert refused(limit=3, scope="queue") == (
        "singleton_limit: task 't.x': 3 per key goes with singleton_scope='run' only, "
        "without a throttle; not with singleton_scope='queue'")
    assert refused("", limit=2, throttle=5.0) == (
        "singleton_limit: 2 per key goes with singleton_scope='run' only, without a "
        "throttle; not with singleton_throttle")


def test_redlock_takes_neither_a_limit_nor_replace():
    redlock = "redlock://127.0.0.1:1/0,127.0.0.1:2/0,127.0.0.1:3/0"
    assert refused(redis_url=redlock, limit=2) == (
        "singleton_limit: task 't.x': 2 per key needs one lock Redis (a server, Sentinel "
        "or Cluster), not redlock://")
    assert refused(redis_url="redlocks://h:1/0", on_duplicate="replace", scope="queue") == (
        "singleton_on_duplicate: task 't.x': 'replace' needs one lock Redis (a server, "
        "Sentinel or Cluster), not redlock://")


def test_replace_needs_a_send_time_key():
    assert refused(on_duplicate="replace") == (
        "singleton_on_duplicate: task 't.x': 'replace' swaps a call that is still queued "
        "for the new one, so it needs a send-time key: set singleton_scope='queue' or "
        "'queue_and_run' (the scope is 'run')")


def test_debounce_needs_replace_and_its_cap_needs_it_and_is_not_shorter():
    assert refused(debounce=2.0, scope="queue") == (
        "singleton_debounce: task 't.x': debouncing pushes back the queued call each time a "
        "send replaces it: set singleton_on_duplicate='replace' (it is 'skip')")
    assert refused(debounce_max=5.0) == (
        "singleton_debounce_max: task 't.x': caps singleton_debounce, which is not set")
    assert refused(debounce=2.5, debounce_max=1.5, on_duplicate="replace",
                   scope="queue") == (
        "singleton_debounce_max: task 't.x': 1.5 s is shorter than singleton_debounce (2.5 s)")


@pytest.mark.parametrize("changes", [
    {}, {"limit": 3}, {"throttle": 5.0, "scope": "queue"},
    {"on_duplicate": "replace", "scope": "queue", "debounce": 2.0, "debounce_max": 2.0},
    {"on_duplicate": "replace", "scope": "queue_and_run", "debounce": 1.0},
    {"redis_url": "redlock://h:1/0,h:2/0,h:3/0", "scope": "queue"},
])
def test_settings_that_go_together_pass(changes):
    check_together("t.x", dataclasses.replace(BASE, **changes))


def test_the_slots_of_a_limit_share_every_key_but_the_owner_record():
    keys = LockKeys("p:", "ab" * 16)
    assert keys.slot(1) is keys
    second = keys.slot(2)
    assert second.lock == "p:{" + "ab" * 16 + "}:lock:2"
    for name in ("base", "fence", "fin", "done", "queued", "throttle", "replaced"):
        assert getattr(second, name) == getattr(keys, name), name
    assert keys.lock == "p:{" + "ab" * 16 + "}:lock", "the first slot's keys are unchanged"
    assert [k.lock for k in keys.slots(3)] == [keys.lock, f"{keys.lock}:2", f"{keys.lock}:3"]
    assert keys.slots(1) == [keys] and keys.slots(0) == []


@pytest.mark.parametrize("check,good,bad,message", [
    ("check_limit", [1, 2, 50], [0, -1, 1.0, True, "2", None],
     "expected a whole number >= 1, got {!r}"),
    ("check_positive_count", [1, 10], [0, -3, 2.5, False, "10"],
     "expected a whole number >= 1, got {!r}"),
    ("check_count", [0, 1, 3], [-1, 0.0, True, "1", None],
     "expected a whole number >= 0, got {!r}"),
    ("check_ms", [1, 100], [0, -5, 100.0, True, "100"],
     "expected milliseconds, a whole number > 0, got {!r}"),
    ("check_str", ["", "singleton:"], [None, 3, b"x"], "expected a string, got {!r}"),
    ("check_dict", [{}, {"password": "x"}], [None, [], "x"], "expected a dict, got {!r}"),
])
def test_each_value_check_passes_good_values_and_names_the_bad(check, good, bad, message):
    from celery_singleton_lock import config

    checker = getattr(config, check)
    for value in good:
        assert checker("singleton_x", value) == value
    for value in bad:
        with pytest.raises(ConfigurationError) as info:
            checker("singleton_x", value)
        assert info.value.setting == "singleton_x"
        assert str(info.value) == "singleton_x: " + message.format(value), value


def test_a_choice_names_every_allowed_value():
    from celery_singleton_lock.config import choice

    policy = choice(("skip", "retry", "raise"), "policy")
    assert policy("singleton_on_duplicate", "retry") == "retry"
    with pytest.raises(ConfigurationError) as info:
        policy("singleton_on_duplicate", "drop")
    assert str(info.value) == ("singleton_on_duplicate: unknown policy 'drop'; expected one "
                               "of: skip, retry, raise")
