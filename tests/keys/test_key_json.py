"""A call's key is the same before and after JSON carried its arguments, for
the values whose JSON form differs from Python's: dict keys that are not
strings, Decimals, floats (no servers)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from celery_singleton_lock.keys import KeyBuilder

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def report(filters: Any) -> None:
    return None


def key(value: Any) -> str:
    return KeyBuilder("t.report", report, None, "singleton:").keys((value,), {}).base


@pytest.mark.parametrize("value", [
    {True: 1, False: 2, None: 3},
    {1: "a", 2.5: "b", -3: "c"},
    {"nested": {True: [1, {None: False}]}},
    [1.0, 2.5, -0.0, 1e300],
])
def test_a_value_and_its_json_round_trip_give_one_key(value):
    assert key(value) == key(json.loads(json.dumps(value)))


def test_dict_keys_that_json_would_merge_or_tell_apart_stay_apart_from_other_values():
    assert key({True: 1}) == key({"true": 1}) != key({"True": 1})
    assert key({False: 1}) == key({"false": 1}) != key({"False": 1})
    assert key({None: 1}) == key({"null": 1}) != key({"None": 1})
    assert key({True: 1}) != key({False: 1}) != key({None: 1})
    assert key({1.5: 1}) == key({"1.5": 1})


def test_decimals_key_by_value_whatever_their_digits():
    assert key(Decimal("1.50")) == key(Decimal("1.5")) != key(Decimal("1.51"))
    assert key(Decimal("NaN")) != key(Decimal("Infinity")) != key(Decimal("-Infinity"))
    assert key(Decimal("Infinity")) == key(Decimal("Infinity"))
