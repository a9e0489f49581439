"""The examples run as a reader runs them (`python examples/<name>/run_demo.py`),
each with its own redis-server and worker subprocesses, and print what their
README and docs/examples.md promise."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support import ROOT, installed, missing

pytestmark = pytest.mark.worker


def run_demo(name: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name / "run_demo.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_a_report_requested_five_times_is_written_once_and_a_pending_rebuild_is_not_repeated():
    out = run_demo("reports_and_cache")
    assert "sent 1, not sent 4; every request got ['reports/2026-10.pdf']" in out
    assert "asked again once it had started: sent=True" in out
    assert "rebuilds that ran: 2" in out


def test_django_settings_in_the_celery_namespace_configure_the_lock():
    installed("django", "the test extra")
    out = run_demo("django_project")
    assert "singleton_ttl=20 (CELERY_SINGLETON_TTL)" in out
    assert "singleton_key_prefix='shop-locks:' (CELERY_SINGLETON_KEY_PREFIX)" in out
    assert "Ship order 1, asked 5 times: 1 ran, 4 skipped" in out
    assert "The lock key used the prefix from settings: True" in out
    assert "Order 1 is shipped, written with the lock's token: True" in out


def test_rabbitmq_broker_with_redis_only_for_locks_runs_one_recount_at_a_time():
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        missing("no RabbitMQ answers on 127.0.0.1:5672")
    out = run_demo("rabbitmq")
    assert "6 recounts of SKU-1234 sent through RabbitMQ: 1 ran, 5 skipped while it ran" in out
    assert "every skip names the running one: True" in out
