"""Keys: one call, one key, whatever its form and whatever JSON did to it on the way."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_singleton_lock import ConfigurationError, KeyEncodingError
from celery_singleton_lock.keys import KeyBuilder, LockKeys

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

PREFIX = "singleton:"
KEY_RE = re.compile(r"^singleton:\{[0-9a-f]{32}\}$")


def charge(order_id: Any, amount: Any = 10, *, currency: Any = "EUR") -> None:
    return None


def key_of(func: Any = charge, spec: Any = None, *args: Any, **kwargs: Any) -> str:
    return KeyBuilder("shop.charge", func, spec, PREFIX).keys(args, kwargs).base


def k(*args: Any, **kwargs: Any) -> str:
    return key_of(charge, None, *args, **kwargs)


# -- binding ------------------------------------------------------------------

def test_positional_keyword_and_defaulted_forms_are_one_key():
    forms = {k(1), k(1, 10), k(1, amount=10), k(order_id=1, amount=10),
             k(1, currency="EUR"), k(amount=10, order_id=1, currency="EUR")}
    assert len(forms) == 1


def test_any_different_value_is_another_key():
    assert len({k(1), k(1, 11), k(2), k(1, currency="USD")}) == 4


def test_the_task_name_is_part_of_the_key():
    a = KeyBuilder("shop.charge", charge, None, PREFIX).keys((1,), {}).base
    b = KeyBuilder("shop.refund", charge, None, PREFIX).keys((1,), {}).base
    assert a != b


def test_var_args_and_var_kwargs_are_bound_too():
    def f(a: Any, *rest: Any, **extra: Any) -> None:
        return None

    assert key_of(f, None, 1, 2, x=3, y=4) == key_of(f, None, 1, 2, y=4, x=3)
    assert key_of(f, None, 1, 2) != key_of(f, None, 1, 2, x=3)
    assert key_of(f, None, 1, 2, 3) != key_of(f, None, 1, 2)


def test_a_call_that_does_not_fit_is_a_clear_error():
    """It says why the call does not fit, and no hint about choosing the key's
    arguments: leaving one out would not make the call fit."""
    with pytest.raises(KeyEncodingError, match=r"shop\.charge") as info:
        k(1, 2, 3, 4)
    assert "too many positional arguments" in str(info.value)
    assert "singleton_key=" not in str(info.value)


# -- singleton_key --------------------------------------------------------------

def test_key_on_a_subset_of_arguments_ignores_the_rest():
    assert key_of(charge, ("order_id",), 1, 10) == key_of(charge, ("order_id",), 1, 99)
    assert key_of(charge, "order_id", 1, 10) == key_of(charge, ("order_id",), order_id=1)
    assert key_of(charge, ("order_id",), 1) != key_of(charge, ("order_id",), 2)
    # A defaulted argument named in the subset counts with its default.
    assert key_of(charge, ("amount",), 1) == key_of(charge, ("amount",), 2, 10)


def test_key_function_decides_the_key():
    def by_customer(order_id: Any, amount: Any = 0, **_: Any) -> Any:
        return order_id // 100

    assert key_of(charge, by_customer, 101) == key_of(charge, by_customer, 199, 5)
    assert key_of(charge, by_customer, 101) != key_of(charge, by_customer, 201)


def test_unknown_argument_name_is_a_configuration_error_naming_it():
    with pytest.raises(ConfigurationError) as info:
        KeyBuilder("shop.charge", charge, ("order", "amount"), PREFIX)
    assert info.value.setting == "singleton_key"
    text = str(info.value)
    assert "shop.charge" in text and "'order'" in text and "order_id" in text


@pytest.mark.parametrize("spec", [(), (1,), ["order_id", 2]])
def test_bad_key_spec_is_a_configuration_error(spec):
    with pytest.raises(ConfigurationError) as info:
        KeyBuilder("shop.charge", charge, spec, PREFIX)
    assert info.value.setting == "singleton_key"


def test_key_function_that_raises_names_the_task():
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise LookupError("no such customer")

    with pytest.raises(KeyEncodingError) as info:
        key_of(charge, broken, 1)
    text = str(info.value)
    assert "shop.charge" in text and "singleton_key" in text and "LookupError" in text
    assert "no such customer" not in text  # its message may carry argument values
    assert "singleton_key=(...)" not in text  # a key function is already the choice


# -- canonical values -------------------------------------------------------------

@pytest.mark.parametrize("a,b", [
    (1, "1"), (1, 1.5), (True, 1), (False, 0), (None, "None"), (None, 0), ("", None),
    ([1, 2], [2, 1]), ({"a": 1}, {"a": "1"}), (b"ab", "ab"), (Decimal("1.1"), 1.1),
    (uuid.UUID(int=1), str(uuid.UUID(int=1))), (dt.date(2026, 1, 2), "2026-01-02"),
    ({1, 2}, [1, 2]), ([], {}), ("a:b", ["a", "b"]),
])
def test_values_of_different_types_differ(a, b):
    assert k(a) != k(b)


@pytest.mark.parametrize("a,b", [
    ((1, 2), [1, 2]),
    ({"x": 1, "y": 2}, {"y": 2, "x": 1}),
    ({1: "a"}, {"1": "a"}),
    (Decimal("1.10"), Decimal("1.1")),
    ({3, 1, 2}, {2, 3, 1}),
    ({"nested": (1, {"b": 2, "a": 1})}, {"nested": [1, {"a": 1, "b": 2}]}),
])
def test_values_that_are_one_call_are_one_key(a, b):
    assert k(a) == k(b)


def test_datetimes_uuids_times_and_bytes_have_one_form():
    u = uuid.uuid4()
    assert k(u) == k(uuid.UUID(str(u)))
    naive = dt.datetime(2026, 11, 22, 10, 30)
    aware = naive.replace(tzinfo=dt.timezone.utc)
    assert k(naive) != k(aware)
    assert k(aware) == k(dt.datetime(2026, 11, 22, 10, 30, tzinfo=dt.timezone.utc))
    assert k(dt.time(10, 30)) != k(dt.time(10, 31))
    assert k(b"\x00\xff") == k(bytearray(b"\x00\xff")) != k(b"\x00\xfe")


# -- the caller and the worker agree ----------------------------------------------

def json_round_trip(value: Any) -> Any:
    content_type, encoding, data = dumps(value, serializer="json")
    return loads(data, content_type, encoding)


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=20),
    st.floats(allow_nan=False, allow_infinity=False), st.uuids(),
    st.datetimes(timezones=st.none() | st.just(dt.timezone.utc)),
    st.decimals(allow_nan=False, allow_infinity=False, places=4),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(order=values, amount=values)
def test_key_survives_kombus_json_round_trip(order, amount):
    args, kwargs = json_round_trip(([order], {"amount": amount}))
    assert k(order, amount=amount) == k(*args, **kwargs)


# -- nothing raw reaches Redis ------------------------------------------------------

def test_key_is_a_fixed_size_hash_with_no_argument_in_it():
    card, email = "4111111111111111", "jane.doe@example.com"
    key = k(card, currency=email)
    assert KEY_RE.match(key), key
    assert card not in key and email not in key
    assert len(k("x" * 10_000)) == len(key)


def test_unencodable_argument_names_task_and_argument_but_not_the_value():
    class Card:
        def __repr__(self) -> str:
            return "Card(4111111111111111)"

    with pytest.raises(KeyEncodingError) as info:
        k(1, amount=Card())
    text = str(info.value)
    assert "shop.charge" in text and "amount" in text and "Card" in text
    assert "4111111111111111" not in text
    assert "Choose the key's arguments with singleton_key=(...)" in text
    with pytest.raises(KeyEncodingError, match="order_id"):
        k(object())


def test_every_key_of_a_lock_shares_one_cluster_hash_tag():
    keys = KeyBuilder("shop.charge", charge, None, PREFIX).keys((1,), {})
    assert isinstance(keys, LockKeys)
    tag = re.escape(keys.base)
    for name in ("lock", "fence", "fin", "queued", "done"):
        assert re.match(rf"^{tag}:{name}$", getattr(keys, name))
    assert len({keys.lock, keys.fence, keys.fin, keys.queued, keys.done}) == 5


def test_fast_binding_agrees_with_inspect_on_every_call_form():
    import inspect
    import itertools

    def f(a: Any, b: Any = 2, c: Any = 3) -> None:
        return None

    builder = KeyBuilder("t", f, None, PREFIX)
    sig = inspect.signature(f)
    names = ["a", "b", "c"]
    for n_pos in range(4):
        for kw_names in itertools.chain.from_iterable(
                itertools.combinations(names, r) for r in range(4)):
            args = tuple(range(10, 10 + n_pos))
            kwargs = {n: f"kw-{n}" for n in kw_names}
            try:
                expected = sig.bind(*args, **kwargs)
            except TypeError:
                with pytest.raises(KeyEncodingError):
                    builder.keys(args, kwargs)
                continue
            expected.apply_defaults()
            assert builder._bind(args, kwargs) == dict(expected.arguments), (args, kwargs)
    with pytest.raises(KeyEncodingError):
        builder.keys((1,), {"zzz": 1})


def pay(order_id: Any, amount: Any, currency: Any = "EUR", meta: Any = None) -> None:
    return None


#: keys as every release so far has written them: a worker on this version and
#: one on the last must take the same key for one call (a rolling deploy)
PINNED: list[tuple[Any, tuple[Any, ...], dict[str, Any], str]] = [
    (None, (7, Decimal("10.50")), {}, "singleton:{37bef946b4033354a3626189c2536c3c}"),
    (None, ("A-1",), {"amount": 3.5, "meta": {"b": [1, True, None], "a": {"x", "y"}}},
     "singleton:{68d85caf27584c5ec78b8113f46d4252}"),
    (None, (uuid.UUID(int=5), b"\x00\xff"),
     {"currency": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)},
     "singleton:{945bc07aaf811b442c89ce15a4b5bb53}"),
    (None, ("é€😀",), {"amount": (1, 2.0, "3"), "meta": dt.date(2026, 1, 2)},
     "singleton:{3c81c72b3eba67bfb79ca036419370d9}"),
    (None, ("\ud800x",), {"amount": -(2**70)}, "singleton:{9a363ff3f85f9df73beec68305f6edf9}"),
    ("order_id", (7, 1), {}, "singleton:{88dad0382f332ac9d13f334ea111cd5e}"),
    (lambda *a, **k: ["x", 1], (7, 1), {}, "singleton:{a7055391b66459559141259fab3d8087}"),
]


@pytest.mark.parametrize("spec,args,kwargs,expected", PINNED)
def test_a_call_takes_the_key_earlier_versions_took(spec: Any, args: tuple[Any, ...],
                                                    kwargs: dict[str, Any],
                                                    expected: str) -> None:
    assert KeyBuilder("shop.pay", pay, spec, PREFIX).keys(args, kwargs).base == expected


def test_a_calls_keys_read_as_the_lock_key_the_task_sees():
    """``str(keys)`` and ``keys.key`` are the lock key: what ``self.singleton.key``
    gives inside the task (a plain call: no Redis) and a skip names; ``lock`` is
    the owner record's Redis key beside it."""
    from celery import Celery

    from celery_singleton_lock import SingletonTask

    app = Celery("keys", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/1"

    @app.task(base=SingletonTask, bind=True, name="t.keys", shared=False,
              singleton_key=("order_id",))
    def charge(self: Any, order_id: int, amount: int) -> str:
        return str(self.singleton.key)

    keys = charge.singleton_keys(42, amount=5)
    seen = charge(42, 5)
    assert re.fullmatch(r"singleton:\{[0-9a-f]{32}\}", seen)
    assert str(keys) == keys.key == f"{keys}" == seen
    assert keys.lock == f"{seen}:lock" and repr(keys) == f"LockKeys({seen!r})"
