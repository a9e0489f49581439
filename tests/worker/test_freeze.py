"""A lock Redis frozen (SIGSTOP) and thawed, on real workers.

A frozen server accepts connections and reads nothing: a call waits for its
reply until ``socket_timeout`` (2 s by default), and Redis runs the command
when it thaws. These tests show what the library does about it:

- a call whose reply never came is undone when the server answers again (an
  acquire would otherwise leave an owner record that nobody holds);
- after one call got no reply, later calls fail at once, so a pool process
  waits at most one timeout per outage and the backend-error policy decides;
- ``celery inspect stats`` answers at once, with the lock part "unknown";
- once the server answers, the tasks that waited run, each within about a
  second, spread out.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import pytest

from celery_singleton_lock import is_skipped
from tests.support import RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

#: a lease far longer than any wait below: a key freed by its lease running
#: out could not explain a test passing
CONF = {"singleton_ttl": 60.0, "singleton_on_backend_error": "retry"}


@pytest.fixture
def frozen_setup(redis_server: RedisServer, own_redis: RedisServer
                 ) -> Iterator[tuple[Worker, Any, RedisServer]]:
    """A worker whose lock Redis (``own_redis``) is not its broker."""
    queue = f"freeze-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, concurrency=2, conf=CONF,
                    lock_url=own_redis.url(2)).start()
    try:
        yield worker, make_app(redis_server.url(), queue, lock_url=own_redis.url(2),
                               conf=CONF), own_redis
    finally:
        if own_redis.proc is not None:
            own_redis.resume()
        discard(worker)


def test_an_acquire_whose_reply_never_came_is_undone_when_redis_thaws(
        frozen_setup: Any, events: Any) -> None:
    """T is sent while the lock Redis is frozen: its acquire gets no reply and T
    waits (backend policy retry). Redis runs that acquire when it thaws, which
    wrote an owner record of an execution that had given up, holding the key
    for the whole 60 s lease (T itself waited for "its running original").
    Now the wire undoes it as soon as the server answers: T runs."""
    worker, app, lock_redis = frozen_setup
    task = app.tasks["t.hold"]
    # both pool processes connected first: a call on a new connection would
    # time out in the connection's handshake, before the acquire was written
    warm = [task.delay(uuid.uuid4().hex[:8], 0.5, "warm") for _ in range(2)]
    for res in warm:
        res.get(timeout=20)
    assert len({e["pid"] for e in events.starts("warm")}) == 2
    key = uuid.uuid4().hex[:8]
    lock_key = task.singleton_keys(key).lock
    lock_redis.pause()
    t = task.delay(key, 0.5, "frozen")
    wait_for(lambda: f"t.hold[{t.id}] (" in worker.logs(), 20,
             what="T's acquire to give up on the frozen Redis")
    lock_redis.resume()
    thawed = time.monotonic()
    admin = lock_redis.client(2)
    # the key is free (the undo ran), or it is T's own run
    wait_for(lambda: not admin.exists(lock_key) or events.starts("frozen"), 30,
             what="the key free, or T running")
    freed = time.monotonic() - thawed
    assert t.get(timeout=30)["tag"] == "frozen"
    assert f"t.hold[{t.id}] waits for its running original" not in worker.logs()
    print(f"\nkey free or T running {freed * 1000:.0f} ms after the thaw")


def test_inspect_stats_answers_at_once_while_the_lock_redis_is_frozen(
        frozen_setup: Any) -> None:
    """The worker's main loop answers ``stats`` (Flower polls it) and ``ping``
    while the lock Redis is frozen; the lock part says it could not tell."""
    worker, app, lock_redis = frozen_setup
    name = worker.name.replace("%h", __import__("socket").gethostname())
    assert app.tasks["t.hold"].delay(uuid.uuid4().hex[:8], 0.0, "warm").get(timeout=20)
    lock_redis.pause()
    inspect = app.control.inspect(destination=[name], timeout=1.5)
    stats = inspect.stats()
    assert stats and name in stats, stats
    summary = stats[name]["singleton locks"]
    assert summary.startswith("unknown (lock Redis"), summary
    assert inspect.ping() == {name: {"ok": "pong"}}
    again = inspect.stats()  # the first read still waits: no second one piles up
    assert again and again[name]["singleton locks"].startswith("unknown (")


def test_after_a_freeze_waiting_tasks_run_soon_and_no_process_is_held(
        frozen_setup: Any, events: Any) -> None:
    """150 tasks, the lock Redis frozen while they run. Each pool process waits
    for a reply once (2 s); every later lock call fails at once and its task is
    sent again within 2 x retry_delay. Once Redis thaws, every task runs, none
    twice at once, and the tasks interrupted by the freeze report it."""
    worker, app, lock_redis = frozen_setup
    task = app.tasks["t.hold"]
    keys = [uuid.uuid4().hex[:8] for _ in range(10)]
    sent = [task.delay(keys[i % 10], 0.05, f"storm{i}") for i in range(150)]
    wait_for(lambda: len(events.starts("storm")) >= 20, 30, what="some tasks to run")
    lock_redis.pause()
    wait_for(lambda: worker.logs().count("RedisUnanswered") >= 20, 60,
             what="20 lock calls failing at once")
    lock_redis.resume()
    thawed = time.monotonic()
    results = [res.get(timeout=90) for res in sent]
    drained = time.monotonic() - thawed
    ran = [r for r in results if not is_skipped(r)]
    assert ran and all(r["token"] > 0 for r in ran)
    assert max(e["concurrent"] for e in events.starts("storm")) == 1
    logs = worker.logs()
    # one unanswered call per process that was calling (2 children, maybe the
    # main process reaping): every other call failed at once
    assert logs.count("did not answer (") <= 3, logs.count("did not answer (")
    assert "answers again" in logs
    print(f"\nall 150 done {drained:.1f} s after the thaw")
