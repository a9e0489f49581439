"""A PostgreSQL database of the test's own on the machine's server (127.0.0.1:5432,
trust auth), created with a random name and dropped at the end; the test is
skipped, saying why, when no PostgreSQL answers (a failure where
SINGLETON_REQUIRE_SERVICES=1)."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator

from tests.support import missing

PG_HOST = os.environ.get("SLT_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("SLT_PG_PORT", "5432"))
PG_USER = os.environ.get("SLT_PG_USER", "postgres")


def admin_dsn(dbname: str = "postgres") -> str:
    return f"host={PG_HOST} port={PG_PORT} user={PG_USER} dbname={dbname} connect_timeout=3"


@contextlib.contextmanager
def own_database() -> Iterator[str]:
    """Yields the DSN of a fresh database ``slt_<random>``; drops it afterwards."""
    try:
        import psycopg
    except ImportError:
        missing("psycopg is not installed (the test extra)")
    try:
        admin = psycopg.connect(admin_dsn(), autocommit=True)
    except psycopg.OperationalError as exc:
        missing(f"no PostgreSQL answers on {PG_HOST}:{PG_PORT}: {exc}".strip())
    name = f"slt_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield admin_dsn(name)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
