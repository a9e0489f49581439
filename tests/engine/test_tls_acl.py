"""TLS and ACL: a worker locking through ``rediss://`` as a restricted ACL user.

The server speaks TLS only, with a certificate the test makes (its own CA);
the worker's user gets exactly ``checks.acl_rule(prefix, db)``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from celery_singleton_lock.checks.doctor import acl_rule
from tests.deployments import TlsServer, make_certificates
from tests.support import Worker, discard, owner_field, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    certs = make_certificates(Path(tmp_path_factory.mktemp("certs")))
    server = TlsServer(certs).start()
    server.client().execute_command(
        "ACL", "SETUSER", "locks", "on", ">s3cret", *acl_rule("singleton:", 2).split())
    yield server
    server.cleanup()


def test_a_worker_locks_over_tls_as_the_minimal_acl_user(tls_server, redis_server, events):
    """singleton_redis_url = rediss://locks:...@host/2?ssl_cert_reqs=required&ssl_ca_certs=ca:
    the worker starts (its start-up checks pass with exactly the documented ACL
    rule), takes and frees locks there, and a duplicate is skipped."""
    lock_url = tls_server.url(2, "locks", "s3cret")
    queue = f"tls-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, lock_url=lock_url).start()
    try:
        app = make_app(redis_server.url(), queue, lock_url=lock_url)
        hold = app.tasks["t.hold"]
        first = hold.delay("k", 1.5, "first")
        wait_for(lambda: events.starts("first"), 15, what="first start")
        lock = hold.singleton_keys("k").lock
        assert owner_field(tls_server.client(2), lock, "task") == first.id
        dup = hold.delay("k", 0.0, "dup").get(timeout=15)
        assert dup["holder"] == first.id
        assert first.get(timeout=15)["token"] > 0
        assert not tls_server.client(2).exists(lock)
        assert "may not" not in worker.logs()
    finally:
        discard(worker)


def test_a_wrong_password_over_tls_stops_the_worker_naming_it(tls_server, redis_server):
    lock_url = tls_server.url(2, "locks", "wrong")
    worker = Worker(redis_server.url(), f"tls-{uuid.uuid4().hex[:8]}", lock_url=lock_url)
    worker.start(wait=False)
    try:
        assert worker.proc is not None
        worker.proc.wait(30)
        text = worker.output() + worker.logs()
        assert "refused the credentials of user 'locks'" in text
        assert "wrong" not in text.replace("wrong password", "")
    finally:
        discard(worker)
