"""A lock Redis killed and restarted empty at any point of the renewal cycle:
the holder writes its lock back, whichever of its renewer's paths reaches the
new server first, and no duplicate runs beside it.

The lease is 3 s, so the renewer renews every second. The restart is placed
at five points of that second, measured from a renewal seen on the key's TTL.
Both as the default user and as the documented minimal ACL user (which may
not run ``INFO``): the write-back does not depend on it, and the Redis ACL
log does not grow while the worker holds its lock.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import redis

from celery_singleton_lock import is_skipped
from celery_singleton_lock.checks.doctor import acl_rule
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

CONF = {"singleton_ttl": 3.0}
#: where in the 1 s renewal cycle the server is killed, seconds after a renewal
OFFSETS = (0.0, 0.2, 0.4, 0.6, 0.8)


def denials(admin: Any) -> int:
    return sum(int(entry.get("count", 1)) for entry in admin.acl_log(128))


class RestartWatch(threading.Thread):
    """Polls the restarting server every 2 ms: when it first answers, when
    the lock is first back on it."""

    def __init__(self, port: int, key: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis(port=port, db=2, socket_timeout=1, socket_connect_timeout=1)
        self.key = key
        self.answered = self.written = 0.0
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                there = self.client.exists(self.key)
            except redis.RedisError:
                time.sleep(0.002)
                continue
            now = time.monotonic()
            self.answered = self.answered or now
            if there:
                self.written = now
                return
            time.sleep(0.002)

    def result(self) -> float:
        """Seconds from the first answer to the lock being back."""
        self.join(25)
        assert self.answered and self.written
        return self.written - self.answered


def wait_for_renewal(admin: Any, lock_key: str) -> None:
    """Until the key's TTL jumps back up: a renewal just landed."""
    last = admin.pttl(lock_key)

    def renewed() -> bool:
        nonlocal last
        now = admin.pttl(lock_key)
        jumped = now > last + 200
        last = now
        return jumped
    wait_for(renewed, 10, interval=0.005, what="a renewal of the held lock")


@pytest.mark.parametrize("user", ["default", "acl"])
def test_a_restart_anywhere_in_the_renewal_cycle_never_lets_a_duplicate_run(
        redis_server: RedisServer, events: Any, user: str) -> None:
    extra: list[str] = []
    if user == "acl":
        extra = ["--user", "locks", "on", ">s3cret", *acl_rule("singleton:", 2).split()]
    lock_server = RedisServer(extra).start()
    auth = "locks:s3cret@" if user == "acl" else ""
    lock_url = f"redis://{auth}127.0.0.1:{lock_server.port}/2"
    queue = f"race-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, concurrency=2, conf=CONF,
                    lock_url=lock_url).start()
    try:
        app = make_app(redis_server.url(), queue, lock_url=lock_url, conf=CONF)
        task = app.tasks["t.hold"]
        key = uuid.uuid4().hex[:8]
        lock_key = task.singleton_keys(key).lock
        holder = task.delay(key, 60.0, "holder")  # until finish:<key> is set
        wait_for(lambda: events.starts("holder"), 15, what="the holder to start")
        admin = lock_server.client(2)
        written: list[float] = []
        for i, offset in enumerate(OFFSETS):
            wait_for_renewal(admin, lock_key)
            time.sleep(offset)  # placing the kill in the cycle, not racing a lease
            lock_server.stop()  # kill -9
            watch = RestartWatch(lock_server.port, lock_key)
            lock_server.start()  # same port, empty
            admin = lock_server.client(2)
            wait_for(lambda: admin.exists(lock_key), 10,  # noqa: B023
                     what=f"the lock written back after restart {i + 1}")
            written.append(watch.result())
            dup = task.delay(key, 0.0, f"dup{i}").get(timeout=20)
            assert is_skipped(dup) and dup["holder"] == holder.id, dup
        if user == "acl":
            before = denials(admin)
            wait_for_renewal(admin, lock_key)
            wait_for_renewal(admin, lock_key)
            assert denials(admin) == before, admin.acl_log(16)
        events.client.set(f"finish:{key}", 1)
        assert holder.get(timeout=40)["lost"] is False
        logs = worker.logs()
        assert "Lost singleton lock" not in logs
        assert logs.count("Took back singleton lock") == len(OFFSETS)
        assert not events.starts("dup")
        assert max(e["concurrent"] for e in events.starts()) == 1
        ms = sorted(w * 1000 for w in written)
        print(f"\n{user}: written back {ms[0]:.0f} / {ms[len(ms) // 2]:.0f} / {ms[-1]:.0f} ms "
              "(min / median / max) after the restarted server first answered")
    finally:
        discard(worker)
        lock_server.cleanup()
