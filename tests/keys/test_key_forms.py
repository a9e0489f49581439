"""Keys of values users pass: pydantic models (validated as a ``pydantic=True``
task's body gets them), enums, dataclasses; the key forms of celery-singleton and
celery-once, as those libraries make them; their task options refused by name."""

from __future__ import annotations

import dataclasses
import enum
import json
import subprocess
import sys
from typing import Any, Optional

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, field_validator

from celery_singleton_lock import (
    ConfigurationError,
    InvalidArgumentsError,
    KeyEncodingError,
    SingletonTask,
)
from celery_singleton_lock.config import check_also_lock
from celery_singleton_lock.keys import KeyBuilder, encode_value
from celery_singleton_lock.rollout import once_key, singleton_key

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


class Order(BaseModel):
    id: int
    note: Optional[str] = None


class Line(BaseModel):
    sku: str
    qty: int = 1


def app_of() -> Celery:
    app = Celery("kf", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"
    return app


# -- pydantic=True: validated as the body gets it ------------------------------------

def test_equal_models_in_every_form_are_one_key_under_pydantic() -> None:
    app = app_of()

    @app.task(base=SingletonTask, pydantic=True, shared=False)
    def pay(order: Order, line: Optional[Line] = None, amount: int = 0) -> None: ...

    forms = [{"id": 2}, {"id": 2, "note": None}, {"id": "2"}, Order(id=2), Order(id="2")]
    assert len({pay.singleton_keys(f).base for f in forms}) == 1
    assert len({pay.singleton_keys(f, {"sku": "a"}).base for f in forms}
               | {pay.singleton_keys(order=f, line=Line(sku="a", qty=1)).base
                  for f in forms}) == 1
    assert pay.singleton_keys({"id": 3}).base != pay.singleton_keys({"id": 2}).base
    assert pay.singleton_keys({"id": 2}, None).base == pay.singleton_keys(Order(id=2)).base
    # a plain annotation is not validated by Celery, so not here either
    assert pay.singleton_keys({"id": 2}, amount="1").base != \
        pay.singleton_keys({"id": 2}, amount=1).base


def test_a_model_that_does_not_validate_is_refused_naming_field_and_reason_not_value() -> None:
    app = app_of()

    @app.task(base=SingletonTask, pydantic=True, shared=False)
    def pay(order: Order) -> None: ...

    with pytest.raises(InvalidArgumentsError) as err:
        pay.singleton_keys({"id": "4111-1111", "note": 5})
    text = str(err.value)
    assert text.startswith(f"task {pay.name!r}: argument 'order' is not a valid Order: ")
    assert "id: Input should be a valid integer" in text and "note: " in text
    assert "4111" not in text
    assert isinstance(err.value, ValueError)
    # the error survives a result backend (rebuilt from its args)
    again = type(err.value)(*err.value.args)
    assert str(again) == text


#: what the validator of Tagged saw as its context
SEEN: list[Any] = []


class Tagged(BaseModel):
    id: int

    @field_validator("id")
    @classmethod
    def record(cls, value: int, info: Any) -> int:
        SEEN.append(info.context)
        return value


def test_the_tasks_own_strictness_and_context_are_the_ones_used() -> None:
    app = app_of()

    @app.task(base=SingletonTask, pydantic=True, pydantic_strict=True, shared=False,
              pydantic_context={"tenant": "t1"})
    def strict(order: Order, tagged: Optional[Tagged] = None) -> None: ...

    with pytest.raises(InvalidArgumentsError, match="valid integer"):
        strict.singleton_keys({"id": "2"})  # strict: a string is no int
    assert strict.singleton_keys({"id": 2}).base == strict.singleton_keys(Order(id=2)).base
    strict.singleton_keys({"id": 2}, {"id": 1})
    assert SEEN[-1]["tenant"] == "t1" and SEEN[-1]["celery_task_name"] == strict.name


def test_a_key_function_and_named_arguments_see_the_validated_model() -> None:
    app = app_of()
    got: list[Any] = []

    def by_order(order: Any, amount: int = 0) -> Any:
        got.append(order)
        return order.id

    @app.task(base=SingletonTask, pydantic=True, shared=False, singleton_key=by_order)
    def pay(order: Order, amount: int = 0) -> None: ...

    @app.task(base=SingletonTask, pydantic=True, shared=False, singleton_key=("order",))
    def pay_named(order: Order, amount: int = 0) -> None: ...

    assert pay.singleton_keys({"id": "5"}, amount=1).base == pay.singleton_keys(Order(id=5)).base
    assert isinstance(got[0], Order)
    assert (pay_named.singleton_keys({"id": "5"}, 1).base
            == pay_named.singleton_keys(Order(id=5), 2).base)


def test_a_key_function_given_to_the_decorator_gets_the_calls_arguments() -> None:
    app = app_of()

    # as docs/concepts.md writes it: a decorator option is a class attribute,
    # which must not be bound to the task as a method
    @app.task(base=SingletonTask, shared=False,
              singleton_key=lambda order_id, **_: order_id % 16)
    def charge(order_id: int, amount: int = 0) -> None: ...

    class ByMethod(SingletonTask):  # type: ignore[misc]
        @staticmethod
        def singleton_key(order_id: int, **_: Any) -> int:
            return order_id % 16

    @app.task(base=ByMethod, shared=False)
    def charge2(order_id: int, amount: int = 0) -> None: ...

    assert charge.singleton_keys(3).base == charge.singleton_keys(19, amount=5).base
    assert charge.singleton_keys(3).base != charge.singleton_keys(4).base
    assert charge2.singleton_keys(3).base == charge2.singleton_keys(19).base


def test_a_bound_task_under_pydantic_is_keyed_the_same_way() -> None:
    app = app_of()

    @app.task(base=SingletonTask, pydantic=True, bind=True, shared=False)
    def pay(self: Any, order: Order) -> None: ...

    assert pay.singleton_keys({"id": "2"}).base == pay.singleton_keys(Order(id=2)).base


def test_without_pydantic_true_a_model_is_keyed_by_its_json_form() -> None:
    app = app_of()

    @app.task(base=SingletonTask, shared=False)
    def plain(order: Any) -> None: ...

    assert plain.singleton_settings().builder.models is None
    assert plain.singleton_keys(Order(id=2)).base == plain.singleton_keys(
        {"id": 2, "note": None}).base
    assert plain.singleton_keys({"id": "2"}).base != plain.singleton_keys({"id": 2}).base


# -- enums and dataclasses ------------------------------------------------------------

class Color(str, enum.Enum):
    RED = "red"


class Size(enum.Enum):
    SMALL = 1
    LARGE = (2, "l")


class Level(enum.IntEnum):
    HIGH = 3


@dataclasses.dataclass
class Point:
    x: int
    y: Any = None


def test_an_enum_member_is_its_value_and_a_dataclass_its_fields() -> None:
    assert encode_value(Color.RED) == encode_value("red")  # what JSON sends for it
    assert encode_value(Level.HIGH) == encode_value(3)
    assert encode_value(Size.SMALL) == encode_value(1)
    assert encode_value(Size.LARGE) == encode_value([2, "l"])
    assert encode_value(Point(1, [Color.RED])) == encode_value({"x": 1, "y": ["red"]})
    assert encode_value(Point(1)) != encode_value(Point(2))
    with pytest.raises(Exception, match="no canonical form"):
        encode_value(Point)  # the class itself is no value


def test_without_pydantic_installed_keys_do_not_change() -> None:
    code = """
import sys
sys.modules["pydantic"] = None  # as if it were not installed
from celery import Celery
from celery_singleton_lock import SingletonTask
from celery_singleton_lock.keys import encode_value
app = Celery("np", broker="redis://127.0.0.1:1/0", set_as_current=False)
app.conf.singleton_redis_url = "redis://127.0.0.1:1/0"
@app.task(base=SingletonTask, shared=False)
def f(a, b=2): ...
print(f.singleton_keys(1).base, f.singleton_settings().builder.models)
try:
    encode_value(object())
except Exception as exc:
    print(type(exc).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    app = app_of()

    @app.task(base=SingletonTask, shared=False, name=__name__ + ".f")
    def f(a: Any, b: Any = 2) -> None: ...

    assert out[1:] == ["None", "_Unencodable"]
    # the same call of a task of the same name and signature keys alike here
    assert out[0] == KeyBuilder("np.f", f.run, None, "singleton:").keys((1,), {}).base
    assert len(out[0]) == len("singleton:{}") + 32


# -- the key forms of celery-singleton and celery-once ----------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(args=st.lists(json_values, max_size=3),
       kwargs=st.dictionaries(st.text(min_size=1, max_size=5), json_values, max_size=3))
def test_celery_singletons_key_is_made_as_celery_singleton_makes_it(args: Any, kwargs: Any
                                                                     ) -> None:
    from celery_singleton.util import generate_lock

    assert singleton_key("SINGLETONLOCK_", "t.x", args, kwargs) == generate_lock(
        "t.x", args, kwargs, key_prefix="SINGLETONLOCK_")
    assert singleton_key("p_", "t.x", tuple(args), kwargs) == generate_lock(
        "t.x", tuple(args), kwargs, key_prefix="p_")


@settings(max_examples=300, deadline=None)
@given(arguments=st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), json_values
                                 | st.tuples(json_values) | st.frozensets(st.integers()),
                                 max_size=4))
def test_celery_onces_key_is_made_as_celery_once_makes_it(arguments: Any) -> None:
    from celery_once.helpers import queue_once_key

    assert once_key("t.x", arguments) == queue_once_key("t.x", arguments)


def test_the_old_key_of_a_task_follows_its_singleton_key_names() -> None:
    from celery_once.helpers import queue_once_key
    from celery_singleton.util import generate_lock

    app = app_of()
    app.conf.ONCE = {"settings": {"url": "redis://127.0.0.1:1/4"}}
    for library in ("celery_singleton", "celery_once"):
        @app.task(base=SingletonTask, shared=False, singleton_key=("account_id",),
                  singleton_also_lock=library, name=f"t.{library}")
        def work(account_id: int, seconds: float = 0.0, tag: str = "") -> None: ...

        other = work.singleton_settings().other
        assert other is not None
        key = other.key((7,), {"tag": "a"})
        assert key == other.key((), {"account_id": 7, "seconds": 1.0})
        if library == "celery_singleton":
            assert key == generate_lock(work.name, [], {"account_id": 7})
            assert other.expiry_ms is None  # as celery-singleton: never expires
        else:
            assert key == queue_once_key(work.name, {"account_id": 7})
            assert other.expiry_ms == 3_600_000  # celery-once's default hour


def test_a_key_function_needs_the_old_keys_arguments_named() -> None:
    app = app_of()

    @app.task(base=SingletonTask, shared=False, singleton_key=lambda a: a,
              singleton_also_lock={"library": "celery_singleton", "url": "redis://h/4"})
    def f(a: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="give the old key's arguments as 'keys'"):
        f.singleton_settings()


@pytest.mark.parametrize("value, message", [
    ("celery-once", "unknown library 'celery-once'"),
    ({"library": "celery_once", "ttl": 3}, "unknown field 'ttl'"),
    ({"library": "celery_once", "url": "http://x"}, "url: expected a redis://"),
    ({"library": "celery_once", "expiry": 0}, "expiry: expected seconds > 0"),
    ({"library": "celery_once", "keys": []}, "keys: expected argument names"),
    (3, "expected 'celery_singleton', 'celery_once' or a dict"),
])
def test_a_bad_also_lock_names_what_is_wrong(value: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        check_also_lock("singleton_also_lock", value)


# -- their task options on a SingletonTask ---------------------------------------------

@pytest.mark.parametrize("options, replacement", [
    ({"unique_on": ["account_id"]}, "use singleton_key=('account_id',)"),
    ({"unique_on": "account_id"}, "use singleton_key=('account_id',)"),
    ({"raise_on_duplicate": True}, "use singleton_on_duplicate='raise'"),
    ({"lock_expiry": 60}, "use singleton_ttl (a lease renewed"),
    ({"once": {"keys": ["account_id"], "graceful": True}},
     "use singleton_key=('account_id',), singleton_scope='queue_and_run'"),
    ({"once": {"unlock_before_run": True}}, "singleton_scope='queue'"),
])
def test_an_option_of_celery_singleton_or_celery_once_is_refused_naming_its_replacement(
        options: dict[str, Any], replacement: str) -> None:
    app = app_of()

    @app.task(base=SingletonTask, shared=False, **options)
    def f(account_id: int, full: bool = False) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        f.delay(7, full=True)
    text = str(err.value)
    assert next(iter(options)) in text and replacement in text, text
    assert "docs/migration.md" in text


def test_key_encoding_error_still_names_an_unencodable_argument() -> None:
    with pytest.raises(KeyEncodingError, match="argument 'a'"):
        KeyBuilder("t", lambda a: None, None, "p:").keys((object(),), {})
    assert json.dumps(encode_value(Color.RED))
