"""Fenced writes (celery_singleton_lock.fencing) on real databases: an update
applies only with a token newer than the row's, a refusal raises StaleTokenError
carrying the table, the row and both tokens, for the DB-API, SQLAlchemy Core and
Django's ORM; PostgreSQL (a database of the test's own) and SQLite."""

from __future__ import annotations

import pickle
import sqlite3
import subprocess
import sys
from typing import Any, Iterator

import pytest

from celery_singleton_lock import StaleTokenError
from celery_singleton_lock.fencing import dbapi_update, sqlalchemy_update
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from tests.pg import own_database
from tests.support import ROOT, installed

SCHEMA = ("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL, "
          "fence BIGINT NOT NULL DEFAULT 0)")
TOKEN = 1_795_448_446_403_762  # the size real tokens have (server clock in µs)


@pytest.fixture(params=["postgresql", "sqlite"])
def cursor(request: Any, tmp_path: Any) -> Iterator[Any]:
    if request.param == "postgresql":
        import psycopg

        with own_database() as dsn, psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
            conn.execute("INSERT INTO orders (id, state) VALUES (42, 'new')")
            yield conn.cursor()
    else:
        conn = sqlite3.connect(tmp_path / "shop.db", isolation_level=None)
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO orders (id, state) VALUES (42, 'new')")
        yield conn.cursor()
        conn.close()


def row(cursor: Any) -> tuple[str, int]:
    cursor.execute("SELECT state, fence FROM orders WHERE id = 42")
    state, fence = cursor.fetchone()
    return state, int(fence)


def test_dbapi_a_newer_token_writes_and_an_older_one_is_refused(cursor):
    assert dbapi_update(cursor, "orders", {"id": 42}, {"state": "charging"}, TOKEN) == 1
    assert row(cursor) == ("charging", TOKEN)
    assert dbapi_update(cursor, "orders", {"id": 42}, {"state": "paid"}, TOKEN + 1) == 1
    with pytest.raises(StaleTokenError) as info:
        dbapi_update(cursor, "orders", {"id": 42}, {"state": "refunded"}, TOKEN)
    err = info.value
    assert (err.table, err.row, err.token, err.stored) == ("orders", {"id": 42}, TOKEN,
                                                           TOKEN + 1)
    assert "stale write to orders {'id': 42} refused" in str(err)
    assert row(cursor) == ("paid", TOKEN + 1), "a refused write changed nothing"


def test_dbapi_a_holder_writes_its_row_again_unless_strict(cursor):
    """The holder's own earlier write (equal token) does not refuse its next one;
    strict=True allows one write per grant."""
    dbapi_update(cursor, "orders", {"id": 42}, {}, TOKEN)  # a claim: fence only
    assert dbapi_update(cursor, "orders", {"id": 42}, {"state": "paid"}, TOKEN) == 1
    assert row(cursor) == ("paid", TOKEN)
    with pytest.raises(StaleTokenError):
        dbapi_update(cursor, "orders", {"id": 42}, {"state": "x"}, TOKEN, strict=True)


def test_dbapi_a_missing_row_is_not_called_stale(cursor):
    with pytest.raises(LookupError, match="no such row"):
        dbapi_update(cursor, "orders", {"id": 7}, {"state": "paid"}, TOKEN)


def test_the_lock_itself_may_be_given_and_the_error_names_its_key(cursor):
    lock = SingletonLock(LockKeys("singleton:", "ab" * 16), token=TOKEN, held=True, lease=30,
                         started=1e18)
    dbapi_update(cursor, "orders", {"id": 42}, {"state": "paid"}, TOKEN + 1)
    with pytest.raises(StaleTokenError) as info:
        dbapi_update(cursor, "orders", {"id": 42}, {"state": "paid"}, lock)
    assert info.value.key == lock.key and lock.key in str(info.value)


def test_identifiers_are_checked_not_interpolated(cursor):
    with pytest.raises(ValueError, match="identifier"):
        dbapi_update(cursor, "orders; DROP TABLE orders", {"id": 42}, {"state": "x"}, TOKEN)
    with pytest.raises(ValueError, match="WHERE"):
        dbapi_update(cursor, "orders", {}, {"state": "x"}, TOKEN)


def test_the_error_survives_a_result_backend_round_trip():
    """Celery rebuilds an exception as cls(*args): nothing is lost on the way."""
    err = StaleTokenError("orders", {"id": 42}, 5, 9, "singleton:{x}")
    again = pickle.loads(pickle.dumps(err))
    assert type(again)(*again.args).__dict__ == err.__dict__ and str(again) == str(err)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_sqlalchemy_core_refuses_a_stale_token(backend, tmp_path):
    sa = installed("sqlalchemy", "the test extra")
    with contextlibs(backend, tmp_path) as url:
        engine = sa.create_engine(url)
        meta = sa.MetaData()
        orders = sa.Table("orders", meta, sa.Column("id", sa.Integer, primary_key=True),
                          sa.Column("state", sa.Text), sa.Column("fence", sa.BigInteger,
                                                                 nullable=False, default=0))
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=42, state="new", fence=0))
        with engine.begin() as conn:
            assert sqlalchemy_update(conn, orders, orders.c.id == 42, {"state": "paid"},
                                     TOKEN) == 1
        with engine.begin() as conn, pytest.raises(StaleTokenError) as info:
            sqlalchemy_update(conn, orders, {"id": 42}, {"state": "refunded"}, TOKEN - 1)
        assert (info.value.table, info.value.row, info.value.stored) == ("orders", {"id": 42},
                                                                         TOKEN)
        with engine.begin() as conn, pytest.raises(StaleTokenError, match=r"orders\.id = 42"):
            sqlalchemy_update(conn, orders, orders.c.id == 42, {"state": "x"}, TOKEN,
                              strict=True)
        with engine.begin() as conn, pytest.raises(LookupError):
            sqlalchemy_update(conn, orders, {"id": 1}, {"state": "x"}, TOKEN)
        # not strict (the default): the holder's second write at its own token
        # goes through (docs/fencing.md: claim, then write)
        with engine.begin() as conn:
            assert sqlalchemy_update(conn, orders, {"id": 42}, {"state": "shipped"},
                                     TOKEN) == 1
        with engine.connect() as conn:
            assert conn.execute(sa.select(orders.c.state, orders.c.fence)).one() == ("shipped",
                                                                                    TOKEN)
        engine.dispose()


def contextlibs(backend: str, tmp_path: Any) -> Any:
    import contextlib

    if backend == "postgresql":
        @contextlib.contextmanager
        def pg() -> Iterator[str]:
            with own_database() as dsn:
                name = dsn.split("dbname=")[1].split()[0]
                yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        return pg()
    return contextlib.nullcontext(f"sqlite:///{tmp_path / 'shop.db'}")


def test_django_orm_refuses_a_stale_token():
    """A model with a fence field, on SQLite through Django's ORM (in a process of its
    own: Django's settings are configured once per process)."""
    installed("django", "the test extra")
    out = subprocess.run([sys.executable, "-m", "tests.djangofencing"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "fenced"
