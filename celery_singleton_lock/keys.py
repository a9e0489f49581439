"""Lock keys: bind a call to its signature, encode it canonically, hash it.

The same logical call must give the same key on the caller and on the worker,
whatever the form of the call and whatever the serializer did to the values on
the way. So:

* arguments are bound to the function's signature and defaults applied:
  ``f(1)``, ``f(1, b=2)`` and ``f(a=1, b=2)`` are one call;
* values carry their type (``1`` and ``"1"`` differ, so do ``True`` and ``1``);
* what JSON cannot tell apart is not told apart here either: a tuple is a list,
  a dict's keys are compared as JSON writes them (``{1: x}`` == ``{"1": x}``);
* UUID, datetime, date, time, Decimal and bytes have one form each, and kombu's
  JSON serializer brings each back as the same type;
* an ``Enum`` member is its value, a dataclass the mapping of its fields and a
  pydantic model its JSON form with its defaults (``model_dump(mode="json")``);
* under ``pydantic=True`` each model-annotated argument is first validated as
  Celery will before the body runs (:mod:`.models`), so every form of one
  model is one key;
* dicts and sets are ordered by their encoded members, so insertion order never
  matters.

Only a fixed-size digest reaches Redis: no raw argument appears in a key.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import inspect
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Callable, Optional, Sequence, Union

from .exceptions import ConfigurationError, KeyEncodingError
from .models import ModelArguments, json_form

KeySpec = Union[None, str, Sequence[str], Callable[..., Any]]

_DIGEST_SIZE = 16  # bytes; 32 hex characters in the key


class _Unencodable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _json_key(key: Any) -> str:
    """A dict key as JSON would write it; what the worker will see."""
    if isinstance(key, str):
        return key
    if key is True:
        return "true"
    if key is False:
        return "false"
    if key is None:
        return "null"
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        return repr(key)
    raise _Unencodable(f"a dict key of type {type(key).__name__}")


def _encode(value: Any, out: list[str]) -> None:
    # Order of checks matters: bool is an int, datetime is a date.
    if value is None:
        out.append("n")
    elif value is True:
        out.append("t")
    elif value is False:
        out.append("f")
    elif isinstance(value, enum.Enum):
        # its value: what JSON sends for a str or int enum, and the one form of the others
        _encode(value.value, out)
    elif isinstance(value, str):
        out.append(f"s{len(value)}:{value}")
    elif isinstance(value, int):
        out.append(f"i{int(value)};")
    elif isinstance(value, float):
        out.append(f"d{value!r};")
    elif isinstance(value, (list, tuple)):
        out.append(f"l{len(value)}[")
        for item in value:
            _encode(item, out)
        out.append("]")
    elif isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            part: list[str] = []
            _encode(v, part)
            items.append((_json_key(k), "".join(part)))
        items.sort()
        out.append(f"m{len(items)}{{")
        for k, v in items:
            out.append(f"s{len(k)}:{k}")
            out.append(v)
        out.append("}")
    elif isinstance(value, (set, frozenset)):
        members = []
        for item in value:
            part = []
            _encode(item, part)
            members.append("".join(part))
        members.sort()
        out.append(f"e{len(members)}{{")
        out.extend(members)
        out.append("}")
    elif isinstance(value, uuid.UUID):
        out.append(f"u{value.hex};")
    elif isinstance(value, dt.datetime):
        out.append(f"T{value.isoformat()};")
    elif isinstance(value, dt.date):
        out.append(f"D{value.isoformat()};")
    elif isinstance(value, dt.time):
        out.append(f"H{value.isoformat()};")
    elif isinstance(value, Decimal):
        # 1.10 and 1.1 are one amount.
        text = str(value.normalize()) if value.is_finite() else str(value)
        out.append(f"x{text};")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out.append(f"y{len(raw)}:{raw.hex()}")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _encode({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, out)
    else:
        dumped = json_form(value)
        if dumped is None:
            raise _Unencodable(f"values of type {type(value).__name__} have no canonical form")
        _encode(dumped, out)


def encode_value(value: Any) -> str:
    """The canonical text of one value (raises ``_Unencodable``)."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out)


def digest(parts: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


class LockKeys:
    """Every Redis key of one lock, sharing one Redis Cluster hash tag
    (``task.singleton_keys(*args, **kwargs)`` gives a call's).

    ``key``   the lock key, ``<prefix>{<digest>}``: what users see as
    ``self.singleton.key``, what a skip's result names and ``celery singleton
    release`` takes; ``str(keys)`` too. Not itself written: the Redis keys
    below are named after it (``base`` is the same string)
    ``lock``  string: the owner record (docs/redis-keys.md), with the lease as its TTL
    ``fence`` string: the last fencing token granted for this key
    ``fin``   string: task id whose execution finished while a copy waited
    ``queued`` string: task id that took the key when it was sent
    ``done``  string: task id whose success keeps the key done (``singleton_done_ttl``)
    ``throttle`` string: task that opened the throttle window (``singleton_throttle``)
    ``rate``     sorted set: the starts within ``singleton_rate``'s window
    ``replaced`` hash: superseded task id -> the task id that replaced it, and
    ``""`` -> when the burst's first send took the key, server ms
    (``singleton_on_duplicate="replace"``)
    ``back``  hash: the lock keys (slots) written back since the server forgot
    the key -> their tokens, ``""`` -> 1 (``lua/reclaim.lua``)
    ``wait:<exec>`` string: a grant still waiting on ``WAIT`` (:meth:`waiting`)
    """

    __slots__ = ("base", "done", "fence", "fin", "lock")

    def __init__(self, prefix: str, hexdigest: str) -> None:
        self.base = f"{prefix}{{{hexdigest}}}"
        self.lock = f"{self.base}:lock"
        self.fence = f"{self.base}:fence"
        self.fin = f"{self.base}:fin"
        self.done = f"{self.base}:done"

    # the keys of the queue scopes, singleton_throttle and replace: made when
    # asked for, not for every task
    @property
    def queued(self) -> str:
        return f"{self.base}:queued"

    @property
    def throttle(self) -> str:
        return f"{self.base}:throttle"

    @property
    def rate(self) -> str:
        """Sorted set: the task ids that started within ``singleton_rate``'s window
        (score: the start, server ms)."""
        return f"{self.base}:rate"

    @property
    def replaced(self) -> str:
        return f"{self.base}:replaced"

    @property
    def back(self) -> str:
        return f"{self.base}:back"

    def waiting(self, exec_id: str) -> str:
        """The marker of execution ``exec_id``'s grant while it waits on
        ``WAIT`` (``singleton_wait_replicas``): its holder is not running yet."""
        return f"{self.base}:wait:{exec_id}"

    def slot(self, number: int) -> LockKeys:
        """These keys with slot ``number``'s owner record as ``lock``
        (``singleton_limit``): slot 1 is ``lock`` itself, slot n ``lock:n``."""
        if number == 1:
            return self
        other = LockKeys.__new__(LockKeys)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other.lock = f"{self.lock}:{number}"
        return other

    def slots(self, count: int) -> list[LockKeys]:
        """The keys of slots 1 to ``count``."""
        return [self.slot(n) for n in range(1, count + 1)]

    @property
    def key(self) -> str:
        """The lock key, ``<prefix>{<digest>}``, as ``self.singleton.key`` gives it."""
        return self.base

    def __str__(self) -> str:
        return self.base

    def __repr__(self) -> str:
        return f"LockKeys({self.base!r})"


class KeyBuilder:
    """Builds the lock keys of one task; the signature is inspected once.

    ``models``: the task's model-annotated arguments (``pydantic=True``), each
    validated before it is keyed, as the body will get it.
    """

    def __init__(
        self, task_name: str, func: Callable[..., Any], spec: KeySpec, prefix: str,
        models: Optional[ModelArguments] = None,
    ) -> None:
        self.task_name = task_name
        self.prefix = prefix
        self.models = models
        self._callable: Optional[Callable[..., Any]] = None
        self._names: Optional[tuple[str, ...]] = None
        try:
            self.signature: Optional[inspect.Signature] = inspect.signature(func)
        except (TypeError, ValueError):  # builtins and C functions
            self.signature = None
        if spec is None:
            pass
        elif callable(spec):
            self._callable = spec
        else:
            names = (spec,) if isinstance(spec, str) else tuple(spec)
            if not names or not all(isinstance(n, str) for n in names):
                raise ConfigurationError(
                    "singleton_key",
                    f"task {task_name!r}: expected argument names, a function or None, "
                    f"got {spec!r}",
                )
            params = self.signature.parameters if self.signature else {}
            missing = [n for n in names if n not in params]
            if missing:
                raise ConfigurationError(
                    "singleton_key",
                    f"task {task_name!r} has no argument named {', '.join(map(repr, missing))} "
                    f"(its arguments: {', '.join(params) or 'none'})",
                )
            self._names = names
        self._plan = self._fast_plan()

    @property
    def names(self) -> Optional[tuple[str, ...]]:
        """The arguments the key is made of (None: all of them, or a function)."""
        return self._names

    def _fast_plan(
        self,
    ) -> Optional[tuple[tuple[str, ...], dict[str, Any], frozenset[str]]]:
        """Names and defaults when every parameter is a plain one (no *args,
        **kwargs, positional-only or keyword-only): then binding is a dict merge."""
        if self.signature is None:
            return None
        names = []
        defaults: dict[str, Any] = {}
        for param in self.signature.parameters.values():
            if param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
                return None
            names.append(param.name)
            if param.default is not inspect.Parameter.empty:
                defaults[param.name] = param.default
        return tuple(names), defaults, frozenset(names)

    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any],
              partial: bool = False) -> dict[str, Any]:
        if self.signature is None:
            return {"*args": list(args), "**kwargs": dict(kwargs)}
        plan = self._plan
        if plan is not None:
            names, defaults, bound_names = plan
            if len(args) <= len(names):
                bound = dict(zip(names, args))
                if not kwargs and len(args) == len(names):  # every argument by position
                    return bound
                if not any(k in bound or k not in bound_names
                           for k in kwargs):
                    bound.update(kwargs)
                    if len(bound) == len(names):
                        return {n: bound[n] for n in names}
                    missing = [n for n in names if n not in bound]
                    if all(n in defaults for n in missing):
                        for n in missing:
                            bound[n] = defaults[n]
                        return {n: bound[n] for n in names}
            # anything unusual: let inspect say what is wrong
        try:
            full = (self.signature.bind_partial if partial else self.signature.bind)(
                *args, **kwargs)
        except TypeError as exc:
            raise KeyEncodingError(self.task_name, "*", f"the call does not fit: {exc}") from None
        full.apply_defaults()
        return dict(full.arguments)

    def arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults applied, as the body will get
        them (raises KeyEncodingError when the call does not fit the signature,
        InvalidArgumentsError when a model argument does not validate)."""
        bound = self._bind(args, kwargs)
        return self.models.validate(bound) if self.models is not None else bound

    def _as_validated(self, args: Sequence[Any], kwargs: Mapping[str, Any]
                      ) -> tuple[list[Any], dict[str, Any]]:
        """The call with each model argument replaced by its validated form,
        in the same place: a positional one stays positional, a named one
        named (a key function ``lambda order_id, **_:`` takes the rest by name)."""
        assert self.models is not None and self.signature is not None
        call = self.signature.bind(*args, **kwargs)
        validated = self.models.validate(dict(call.arguments))
        by_position = [p.name for p in self.signature.parameters.values()
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        new_args = [validated[by_position[i]] if i < len(by_position) else a
                    for i, a in enumerate(args)]
        named = {p.name for p in self.signature.parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        new_kwargs = {k: validated[k] if k in named else v for k, v in kwargs.items()}
        return new_args, new_kwargs

    def keys(self, args: Sequence[Any], kwargs: Mapping[str, Any], *,
             partial: bool = False) -> LockKeys:
        """The lock keys of a call. ``partial``: the call may leave out arguments
        the key is not made of (``celery singleton key`` with only the key's)."""
        parts = [self.task_name]
        if self._callable is not None:
            if self.models is not None and self.signature is not None:
                # the key function sees the arguments as the body will, each
                # passed as the caller passed it (by position or by name)
                args, kwargs = self._as_validated(args, kwargs)
            try:
                value = self._callable(*args, **kwargs)
            except Exception as exc:
                raise KeyEncodingError(
                    self.task_name, "singleton_key", f"the key function raised {type(exc).__name__}"
                ) from exc
            try:
                parts.append(encode_value(value))
            except _Unencodable as exc:
                raise KeyEncodingError(
                    self.task_name, "singleton_key", f"the key function returned {exc.reason}"
                ) from None
            return LockKeys(self.prefix, digest(parts))
        partial = partial and self._names is not None
        arguments = self._bind(args, kwargs, partial)
        names = self._names if self._names is not None else tuple(arguments)
        if partial:
            absent = [n for n in names if n not in arguments]
            if absent:
                raise KeyEncodingError(self.task_name, "*", "the key is made of "
                                       f"{', '.join(names)}: give {', '.join(absent)}")
        if self.models is not None:
            arguments = self.models.validate({n: arguments[n] for n in names})
        for name in names:
            try:
                parts.append(f"{name}={encode_value(arguments[name])}")
            except _Unencodable as exc:
                raise KeyEncodingError(self.task_name, name, exc.reason) from None
        return LockKeys(self.prefix, digest(parts))
