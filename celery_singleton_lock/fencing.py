"""Fenced writes: apply an update only when no later lock holder has written the row.

A lease can lapse while its holder still runs (a GC or process pause, a
network delay, a Redis failover). Only the resource written to can refuse the
late writer: each row keeps the last token that wrote it, and an update applies
only when the row's token is lower than the writer's, or is the writer's own
(its earlier write in the same execution; ``strict=True`` refuses that too).
The token is ``self.singleton.token``; pass ``self.singleton`` itself and a
refusal also names the lock.

The row needs one integer column (``fence`` by default; tokens need 64 bits)::

    ALTER TABLE orders ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;

Then, inside a bound ``SingletonTask``::

    from celery_singleton_lock.fencing import dbapi_update

    dbapi_update(cursor, "orders", {"id": order_id}, {"state": "paid"}, self.singleton)

issues one statement,
``UPDATE orders SET state = %s, fence = %s WHERE id = %s AND (fence IS NULL OR fence <= %s)``.
When it changes no row, the row's stored token is read and
:class:`~celery_singleton_lock.exceptions.StaleTokenError` is raised (with the
table, the row, both tokens and the lock's key); a row that does not exist
raises :class:`LookupError`. The update and the check happen in the caller's
transaction: commit as usual. One statement is atomic in every SQL database,
so two writers racing on the row cannot both pass the check.

Three flavours, for where users write:

:func:`dbapi_update`       a DB-API cursor (psycopg, psycopg2, sqlite3, ...)
:func:`sqlalchemy_update`  a SQLAlchemy Core connection and ``Table``
:func:`django_update`      a Django queryset (``Model.objects.filter(...)``)

A task that holds no lock (token 0: eager mode, a run under
``singleton_on_backend_error="run"``) may write only rows no holder has written
yet (fence 0), and is refused by every other.

Nothing here is imported by ``celery_singleton_lock`` itself, and each
flavour imports its database library only when called.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

from .exceptions import StaleTokenError
from .lock import SingletonLock

if TYPE_CHECKING:
    import sqlalchemy

__all__ = ["Fence", "dbapi_update", "django_update", "fence_of", "sqlalchemy_update"]

#: a fencing token, or the lock that carries one (``self.singleton``)
Fence = Union[int, SingletonLock]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


def fence_of(fence: Fence) -> tuple[int, Optional[str]]:
    """The token and, for a lock, its key."""
    if isinstance(fence, SingletonLock):
        return int(fence.token), fence.key
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError(f"expected a fencing token (int) or self.singleton, got {fence!r}")
    return fence, None


def _quote(name: str) -> str:
    """An identifier, checked and quoted: table and column names cannot be parameters."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return ".".join(f'"{part}"' for part in name.split("."))


def _op(strict: bool) -> str:
    return "<" if strict else "<="


def _placeholders(paramstyle: str) -> Any:
    """A function giving the i-th (1-based) placeholder of ``paramstyle``."""
    if paramstyle == "qmark":
        return lambda i: "?"
    if paramstyle in ("format", "pyformat"):
        return lambda i: "%s"
    if paramstyle == "numeric":
        return lambda i: f":{i}"
    raise ValueError(f"unsupported DB-API paramstyle {paramstyle!r} "
                     "(qmark, numeric, format and pyformat are)")


def _paramstyle_of(cursor: Any) -> str:
    """The paramstyle of the DB-API module the cursor comes from."""
    module = type(cursor).__module__
    while module:
        try:
            style = getattr(importlib.import_module(module), "paramstyle", None)
        except ImportError:
            style = None
        if isinstance(style, str):
            return style
        module = module.rpartition(".")[0]
    raise ValueError(f"cannot tell the paramstyle of {type(cursor).__name__}: pass paramstyle=")


def dbapi_update(cursor: Any, table: str, where: Mapping[str, Any], values: Mapping[str, Any],
                 fence: Fence, *, fence_column: str = "fence",
                 paramstyle: Optional[str] = None, strict: bool = False) -> int:
    """``UPDATE table SET values, fence_column = token WHERE where AND fence_column <= token``.

    ``where`` selects the row by column equality (``{"id": 42}``); ``fence``
    is ``self.singleton`` or its token. Returns the number of rows updated
    (at least 1). Raises :class:`StaleTokenError` when the selected row holds a
    newer token (with ``strict=True``: this token or a newer one),
    :class:`LookupError` when no row matches.
    The caller commits.
    """
    token, key = fence_of(fence)
    if not where:
        raise ValueError("a fenced update needs a WHERE: which row?")
    mark = _placeholders(paramstyle or _paramstyle_of(cursor))
    params: list[Any] = []

    def p(value: Any) -> str:
        params.append(value)
        return str(mark(len(params)))

    sets = [f"{_quote(c)} = {p(v)}" for c, v in values.items() if c != fence_column]
    sets.append(f"{_quote(fence_column)} = {p(token)}")
    cond = [f"{_quote(c)} = {p(v)}" for c, v in where.items()]
    fc = _quote(fence_column)
    cond.append(f"({fc} IS NULL OR {fc} {_op(strict)} {p(token)})")
    cursor.execute(f"UPDATE {_quote(table)} SET {', '.join(sets)} WHERE {' AND '.join(cond)}",
                   params)
    if cursor.rowcount and cursor.rowcount > 0:
        return int(cursor.rowcount)
    params = []
    cond = [f"{_quote(c)} = {p(v)}" for c, v in where.items()]
    cursor.execute(f"SELECT MAX({fc}), COUNT(*) FROM {_quote(table)} WHERE {' AND '.join(cond)}",
                   params)
    stored, count = cursor.fetchone()
    if not count:
        raise LookupError(f"fenced update of {table} {dict(where)!r}: no such row")
    raise StaleTokenError(table, dict(where), token, None if stored is None else int(stored), key)


def sqlalchemy_update(connection: sqlalchemy.Connection, table: sqlalchemy.Table,
                      where: Any, values: Mapping[str, Any], fence: Fence, *,
                      fence_column: str = "fence", strict: bool = False) -> int:
    """The same through SQLAlchemy Core: ``where`` is a column expression
    (``orders.c.id == 42``) or a mapping of column names to values.

    Returns the number of rows updated; raises :class:`StaleTokenError` or
    :class:`LookupError` like :func:`dbapi_update`. The caller commits
    (``engine.begin()``).
    """
    import sqlalchemy as sa

    token, key = fence_of(fence)
    column = table.c[fence_column]
    if isinstance(where, Mapping):
        if not where:
            raise ValueError("a fenced update needs a WHERE: which row?")
        row: object = dict(where)
        clause = sa.and_(*(table.c[name] == value for name, value in where.items()))
    else:
        row = str(where.compile(compile_kwargs={"literal_binds": True}))
        clause = where
    result = connection.execute(
        sa.update(table)
        .where(clause, sa.or_(column.is_(None), column < token if strict else column <= token))
        .values({**values, fence_column: token})
    )
    if result.rowcount and result.rowcount > 0:
        return int(result.rowcount)
    stored, count = connection.execute(
        sa.select(sa.func.max(column), sa.func.count()).select_from(table).where(clause)).one()
    if not count:
        raise LookupError(f"fenced update of {table.name} {row!r}: no such row")
    raise StaleTokenError(table.name, row, token, None if stored is None else int(stored), key)


def django_update(queryset: Any, fence: Fence, *, fence_field: str = "fence",
                  strict: bool = False, **values: Any) -> int:
    """The same with Django's ORM: ``queryset.update(**values, fence=token)`` on the
    rows of ``queryset`` whose fence is not newer than the token.

    ``queryset`` selects the row (``Order.objects.filter(pk=order_id)``).
    Returns the number of rows updated; raises :class:`StaleTokenError` or
    :class:`LookupError` like :func:`dbapi_update`. Run it in
    ``transaction.atomic()`` with the rest of the task's writes.
    """
    from django.db.models import Q

    token, key = fence_of(fence)
    lookup = "lt" if strict else "lte"
    stale_ok = Q(**{f"{fence_field}__isnull": True}) | Q(**{f"{fence_field}__{lookup}": token})
    updated = int(queryset.filter(stale_ok).update(**{**values, fence_field: token}))
    if updated:
        return updated
    table = str(queryset.model._meta.db_table)
    rows = list(queryset.values_list("pk", fence_field)[:10])
    if not rows:
        raise LookupError(f"fenced update of {table}: no row matches the queryset")
    pks = [pk for pk, _ in rows]
    stored = max((f for _, f in rows if f is not None), default=None)
    raise StaleTokenError(table, {"pk": pks[0] if len(pks) == 1 else pks}, token,
                          None if stored is None else int(stored), key)
