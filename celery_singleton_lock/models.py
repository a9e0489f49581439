"""Arguments as the body of a ``pydantic=True`` task sees them.

Celery (5.5 and later) wraps such a task's function: before the body runs,
each argument annotated with a pydantic model (or ``Optional`` of one) is
validated into that model. ``{"id": 2}``, ``{"id": 2, "note": None}``,
``{"id": "2"}`` and ``Order(id=2)`` all reach the body as one equal
``Order``, so they are one call and must give one key. Here each such argument
is validated the same way (the task's ``pydantic_strict`` and
``pydantic_context`` included) and keyed by the model's JSON form with its
defaults, ``model_dump(mode="json")``.

A call whose arguments do not validate could never run: it is refused with
:class:`~.exceptions.InvalidArgumentsError`, which names each failing field
and never the value sent.

Nothing here imports pydantic: a task that is not wrapped never gets here,
and a wrapped one means pydantic is installed.
"""

from __future__ import annotations

import inspect
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Callable, Optional

from .exceptions import InvalidArgumentsError

#: where Celery's wrapper of a ``pydantic=True`` task is defined
_WRAPPER_HOME = ("celery", "app", "base.py")


def _closure(func: Any) -> dict[str, Any]:
    """The variables ``func`` closes over, by name (empty for a plain function)."""
    code = getattr(func, "__code__", None)
    cells = getattr(func, "__closure__", None) or ()
    if code is None:
        return {}
    found: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
    return found


def _celery_wrapper(run: Any) -> Optional[Any]:
    """Celery's pydantic wrapper when ``run`` is one (bound or not), else None."""
    func = getattr(run, "__func__", run)
    code = getattr(func, "__code__", None)
    if code is None or not hasattr(func, "__wrapped__"):
        return None
    home = code.co_filename.replace("\\", "/").split("/")[-3:]
    if code.co_name != "wrapper" or tuple(home) != _WRAPPER_HOME:
        return None
    return func


def _optional_of(annotation: Any) -> Any:
    """``X`` for ``Optional[X]`` (and ``X | None``), else None."""
    origin = typing.get_origin(annotation)
    union_type = getattr(types, "UnionType", None)
    if origin is not typing.Union and (union_type is None or origin is not union_type):
        return None
    members = typing.get_args(annotation)
    others = [m for m in members if m is not type(None)]
    if len(members) != 2 or len(others) != 1:
        return None
    return others[0]


class ModelArguments:
    """Validates the model-annotated arguments of one ``pydantic=True`` task."""

    def __init__(self, task_name: str, func: Callable[..., Any], *, strict: bool = False,
                 context: Optional[Mapping[str, Any]] = None, app: Any = None) -> None:
        import pydantic  # installed: Celery's wrapper needs it

        self.task_name = task_name
        self.strict = strict
        self._context = {**(context or {}), "celery_app": app, "celery_task_name": task_name}
        try:
            hints = typing.get_type_hints(func)
        except (NameError, AttributeError, TypeError):
            hints = {}
        #: argument name -> (annotated model, may be None)
        self.models: dict[str, tuple[type[Any], bool]] = {}
        for name, param in inspect.signature(func).parameters.items():
            annotation = hints.get(name, param.annotation)
            inner = _optional_of(annotation)
            model, optional = (inner, True) if inner is not None else (annotation, False)
            if inspect.isclass(model) and issubclass(model, pydantic.BaseModel):
                self.models[name] = (model, optional)

    @classmethod
    def of(cls, task_name: str, run: Any, app: Any = None) -> Optional[ModelArguments]:
        """The validator of a task whose ``run`` is Celery's pydantic wrapper, with
        the wrapper's own ``pydantic_strict`` and ``pydantic_context``; None for
        any other task, or one without a model argument."""
        wrapper = _celery_wrapper(run)
        if wrapper is None:
            return None
        # the wrapper validates through a helper that holds the task's choices
        helper = _closure(_closure(wrapper).get("validate_argument"))
        context = helper.get("context")
        found = cls(task_name, wrapper.__wrapped__, strict=bool(helper.get("strict", False)),
                    context=context if isinstance(context, Mapping) else None,
                    app=helper.get("app", app))
        return found if found.models else None

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments`` (bound by name) with each model argument as the body gets
        it; raises InvalidArgumentsError naming every field that fails."""
        import pydantic

        out = dict(arguments)
        for name, (model, optional) in self.models.items():
            if name not in out or (optional and out[name] is None):
                continue
            try:
                out[name] = model.model_validate(out[name], strict=self.strict,
                                                 context=self._context)
            except pydantic.ValidationError as exc:
                problems = [
                    f"{'.'.join(str(p) for p in err['loc']) or '(the value)'}: {err['msg']}"
                    for err in exc.errors(include_input=False, include_url=False)
                ]
                raise InvalidArgumentsError(self.task_name, name, model.__name__,
                                            "; ".join(problems)) from None
        return out


def json_form(value: Any) -> Optional[Any]:
    """A pydantic model's JSON form with its defaults; None when ``value`` is no model."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None or not isinstance(value, pydantic.BaseModel):
        return None
    return value.model_dump(mode="json")
