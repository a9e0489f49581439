"""Keys of calls to every kind of signature, the partial call of ``celery
singleton key``, and each refusal's exact text (no servers)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Optional

import pytest
from celery import Celery
from pydantic import BaseModel

from celery_singleton_lock import (
    ConfigurationError,
    InvalidArgumentsError,
    KeyEncodingError,
    SingletonTask,
)
from celery_singleton_lock.keys import KeyBuilder
from celery_singleton_lock.models import ModelArguments

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

PREFIX = "singleton:"


def pay(order_id: Any, amount: Any, currency: Any = "EUR", meta: Any = None) -> None:
    return None


def spread(a: Any, *rest: Any, **extra: Any) -> None:
    return None


def tail(*rest: Any) -> None:
    return None


def key(func: Any, spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        partial: bool = False) -> str:
    return KeyBuilder("shop.pay", func, spec, PREFIX).keys(args, kwargs, partial=partial).base


#: keys as this release writes them: a worker on the next one must take the
#: same key for one call (a rolling deploy)
PINNED: list[tuple[Any, tuple[Any, ...], dict[str, Any], str]] = [
    (pay, (False, {("a", 1), ("b", 2)}),
     {"meta": [Decimal("sNaN"), Decimal("-Infinity")]},
     "singleton:{2f2b1c9262ff9bd438f0dbb1244e3f9c}"),
    (spread, (1, 2, 3), {"x": 4}, "singleton:{82f26c6f183f14b1d9c880b229f354f4}"),
    (tail, (1,), {}, "singleton:{3a0d1dcd980334efb021ced31a4f9c29}"),
    # a builtin: no signature to bind to, so its arguments as given
    (max, (3, 4), {"default": 0}, "singleton:{d8afcb2f18fd9cd1a371bc5a9d3f0aa7}"),
]


@pytest.mark.parametrize("func,args,kwargs,expected", PINNED,
                         ids=["values", "var-args", "only-var-args", "builtin"])
def test_a_call_takes_the_key_this_release_takes(func: Any, args: tuple[Any, ...],
                                                  kwargs: dict[str, Any], expected: str) -> None:
    assert key(func, None, args, kwargs) == expected


def test_var_args_are_one_tuple_whatever_they_hold() -> None:
    assert key(tail, None, (1,), {}) != key(tail, None, ((1,),), {})
    assert key(tail, None, (1, 2), {}) != key(tail, None, ((1, 2),), {})


def test_a_call_missing_an_argument_says_which() -> None:
    with pytest.raises(KeyEncodingError) as info:
        key(pay, None, (), {"amount": 1, "currency": "USD", "meta": None})
    assert str(info.value) == ("task 'shop.pay': no singleton key for this call: "
                               "the call does not fit: missing a required argument: 'order_id'")
    with pytest.raises(KeyEncodingError, match="missing a required argument: 'amount'"):
        KeyBuilder("shop.pay", pay, ("order_id",), PREFIX).keys((7,), {})  # a whole call
    with pytest.raises(KeyEncodingError, match="missing a required argument: 'amount'"):
        KeyBuilder("shop.pay", pay, None, PREFIX).arguments((7,), {})


def test_a_partial_call_needs_only_the_keys_arguments() -> None:
    """``celery singleton key`` gives only the arguments the key is made of."""
    whole = key(pay, ("order_id",), (7, 100), {})
    assert key(pay, ("order_id",), (), {"order_id": 7}, partial=True) == whole
    assert key(pay, ("order_id",), (7,), {}, partial=True) == whole
    with pytest.raises(KeyEncodingError) as info:
        key(pay, ("order_id", "amount", "currency"), (), {"order_id": 7}, partial=True)
    assert str(info.value) == ("task 'shop.pay': no singleton key for this call: the key is "
                               "made of order_id, amount, currency: give amount")
    with pytest.raises(KeyEncodingError) as info:
        key(pay, ("order_id", "amount"), (), {"currency": "USD"}, partial=True)
    assert str(info.value).endswith("the key is made of order_id, amount: give order_id, amount")
    # without named arguments every one is the key's: a partial call is a whole one
    with pytest.raises(KeyEncodingError, match="missing a required argument: 'amount'"):
        key(pay, None, (7,), {}, partial=True)


def test_a_key_function_gets_keyword_arguments_as_given() -> None:
    def by_order(order_id: Any, amount: Any = 0, **_: Any) -> Any:
        return order_id

    assert key(pay, by_order, (), {"order_id": 7, "amount": 1}) == key(pay, by_order, (7, 2), {})


def test_a_key_function_returning_what_has_no_key_says_so_naming_the_task() -> None:
    with pytest.raises(KeyEncodingError) as info:
        key(pay, lambda *a, **k: object(), (7, 1), {})
    assert str(info.value) == ("task 'shop.pay': singleton_key: the key function returned "
                               "values of type object have no canonical form")


def test_a_dict_key_json_cannot_write_names_its_type() -> None:
    with pytest.raises(KeyEncodingError) as info:
        key(pay, None, (7, 1), {"meta": {(1, 2): "x"}})
    assert "argument 'meta' cannot be part of a singleton key: a dict key of type tuple" in str(
        info.value)


def test_a_bad_key_spec_says_what_is_expected() -> None:
    with pytest.raises(ConfigurationError) as info:
        KeyBuilder("shop.pay", pay, (), PREFIX)
    assert str(info.value) == ("singleton_key: task 'shop.pay': expected argument names, a "
                               "function or None, got ()")


def test_argument_names_the_task_lacks_are_listed_with_the_ones_it_has() -> None:
    with pytest.raises(ConfigurationError) as info:
        KeyBuilder("shop.pay", pay, ("order", "sum", "amount"), PREFIX)
    assert str(info.value) == ("singleton_key: task 'shop.pay' has no argument named 'order', "
                               "'sum' (its arguments: order_id, amount, currency, meta)")
    with pytest.raises(ConfigurationError) as info:
        KeyBuilder("shop.max", max, ("a",), PREFIX)
    assert str(info.value) == ("singleton_key: task 'shop.max' has no argument named 'a' "
                               "(its arguments: none)")


class Order(BaseModel):
    id: int
    note: Optional[str] = None


def test_under_pydantic_a_key_function_gets_a_model_given_by_keyword() -> None:
    app = Celery("kb", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"

    @app.task(base=SingletonTask, pydantic=True, shared=False,
              singleton_key=lambda order, amount=0: order.id)
    def charge(order: Order, amount: int = 0) -> None: ...

    assert (charge.singleton_keys(order={"id": "5"}, amount=1).base
            == charge.singleton_keys(Order(id=5)).base)


def test_under_pydantic_a_key_function_takes_the_rest_by_name_as_the_docs_write_it() -> None:
    """docs/concepts.md's ``lambda order_id, **_:`` form: with ``pydantic=True``
    the validated arguments reach the key function as the caller passed them,
    a positional one by position and a named one by name."""
    app = Celery("kb", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"
    seen: list[tuple[Any, ...]] = []

    def by_order(order: Order, **rest: Any) -> int:
        seen.append((order, rest))
        return order.id

    @app.task(base=SingletonTask, pydantic=True, shared=False, singleton_key=by_order)
    def charge(order: Order, amount: int = 0) -> None: ...

    first = charge.singleton_keys(Order(id=5), amount=1).base
    assert charge.singleton_keys({"id": "5"}, amount=2).base == first
    assert charge.singleton_keys(order={"id": 5}).base == first
    assert seen == [(Order(id=5), {"amount": 1}), (Order(id=5), {"amount": 2}),
                    (Order(id=5), {})]


def test_a_calls_arguments_are_bound_by_name_with_models_as_the_body_gets_them() -> None:
    assert KeyBuilder("shop.pay", pay, None, PREFIX).arguments((7,), {"amount": 1}) == {
        "order_id": 7, "amount": 1, "currency": "EUR", "meta": None}

    def charge(order: Order, amount: int = 0) -> None: ...

    builder = KeyBuilder("shop.charge", charge, None, PREFIX,
                         models=ModelArguments("shop.charge", charge))
    assert builder.arguments(({"id": "5"},), {}) == {"order": Order(id=5), "amount": 0}
    with pytest.raises(InvalidArgumentsError, match="id"):
        builder.arguments(({"id": "five"},), {})


def test_under_pydantic_a_key_function_gets_extra_arguments_as_they_were_passed() -> None:
    """Arguments past the named ones (``*more``, ``**extra``) reach the key
    function as the caller passed them; only model arguments are validated."""
    seen: list[tuple[Any, ...]] = []

    def key(order: Order, *more: Any, **extra: Any) -> int:
        seen.append((order, more, extra))
        return order.id

    def charge(order: Order, *more: Any, **extra: Any) -> None: ...

    builder = KeyBuilder("shop.charge", charge, key, PREFIX,
                         models=ModelArguments("shop.charge", charge))
    first = builder.keys(({"id": "5"}, "a", {"id": "6"}), {"note": "x", "order_no": 7}).base
    assert seen == [(Order(id=5), ("a", {"id": "6"}), {"note": "x", "order_no": 7})]
    assert builder.keys((Order(id=5),), {}).base == first
    assert seen[1] == (Order(id=5), (), {})
