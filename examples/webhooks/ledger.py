"""The shop's database: orders and the charges taken for them.

``WEBHOOKS_DATABASE`` names it: a PostgreSQL URL (``postgresql://user@host/db``)
or ``sqlite:///path/to/file.db``. Every function opens its own connection, as a
task in a pool process would.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from typing import Any, Iterator

DATABASE = os.environ.get("WEBHOOKS_DATABASE", "sqlite:///webhooks.db")

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders ("
    " id INTEGER PRIMARY KEY, amount_cents INTEGER NOT NULL,"
    " state TEXT NOT NULL DEFAULT 'new',"
    " fence BIGINT NOT NULL DEFAULT 0)",  # the last fencing token that wrote the row
    "CREATE TABLE IF NOT EXISTS charges ("
    " order_id INTEGER NOT NULL, amount_cents INTEGER NOT NULL,"
    " token BIGINT NOT NULL, task_id TEXT NOT NULL)",
)


SQLITE = DATABASE.startswith("sqlite:///")


def q(sql: str) -> str:
    """Placeholders: psycopg's ``%s``, sqlite3's ``?``."""
    return sql.replace("%s", "?") if SQLITE else sql


def connect() -> Any:
    if SQLITE:
        return sqlite3.connect(DATABASE[len("sqlite:///"):], timeout=30)
    import psycopg

    return psycopg.connect(DATABASE)


@contextlib.contextmanager
def transaction() -> Iterator[Any]:
    """A cursor in one transaction: committed at the end, rolled back on error."""
    conn = connect()
    try:
        cursor = conn.cursor()
        yield cursor
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        conn.close()


def create(orders: dict[int, int]) -> None:
    """The tables, and the given orders (id -> amount in cents), all unpaid."""
    with transaction() as cur:
        for statement in SCHEMA:
            cur.execute(statement)
        for order_id, cents in orders.items():
            cur.execute(q("DELETE FROM charges WHERE order_id = %s"), (order_id,))
            cur.execute(q("DELETE FROM orders WHERE id = %s"), (order_id,))
            cur.execute(q("INSERT INTO orders (id, amount_cents) VALUES (%s, %s)"),
                        (order_id, cents))


def state(cursor: Any, order_id: int) -> str:
    cursor.execute(q("SELECT state FROM orders WHERE id = %s"), (order_id,))
    return str(cursor.fetchone()[0])


def record_charge(cursor: Any, order_id: int, cents: int, token: int, task_id: str) -> None:
    """The money taken: one row per charge (a double charge is two rows)."""
    cursor.execute(q("INSERT INTO charges (order_id, amount_cents, token, task_id) "
                     "VALUES (%s, %s, %s, %s)"), (order_id, cents, token, task_id))


def charges(order_id: int) -> list[tuple[int, int, str]]:
    """(amount in cents, token, task id) of every charge taken for the order."""
    with transaction() as cur:
        cur.execute(q("SELECT amount_cents, token, task_id FROM charges WHERE order_id = %s"),
                    (order_id,))
        return [(int(a), int(t), str(i)) for a, t, i in cur.fetchall()]


def order(order_id: int) -> tuple[str, int]:
    """(state, fence) of the order."""
    with transaction() as cur:
        cur.execute(q("SELECT state, fence FROM orders WHERE id = %s"), (order_id,))
        st, fence = cur.fetchone()
        return str(st), int(fence)
