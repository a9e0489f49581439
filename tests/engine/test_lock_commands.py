"""What a task costs the lock Redis, counted by Redis itself (``INFO commandstats``).

Every string passed to a script and every command run inside one costs Redis
CPU (docs/benchmarks-details.md, "Where the lock Redis spends its time"): a change
that adds one to the usual paths fails here, and says which.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import RECORD_FIELDS, Acquire
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.support import ROOT, RedisServer, owner_record

ROUNDS = 50

#: per task: one acquire, its confirmation (renew.lua: the grant lives until
#: its request's deadline until its holder confirms it) and one release, each
#: one EVALSHA (a task with the default settings: no done window, so no done
#: marker is looked for)
TASK_COMMANDS = {"evalsha": 3, "get": 4, "set": 2, "time": 1, "del": 1, "pexpire": 2}
#: per skipped duplicate: one acquire that finds the key held, and how long it
#: has left (a grant not confirmed yet is waited for, not skipped against)
SKIP_COMMANDS = {"evalsha": 1, "get": 1, "pttl": 1}
#: with ``singleton_done_ttl``, the acquire also reads the done marker
DONE_WINDOW_EXTRA = {"get": 1}


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def engine_on(server: RedisServer) -> LockEngine:
    return connect(SingletonConfig.defaults(server.url(0)))


def counted(client: redis.Redis, run) -> Counter[str]:
    """Commands Redis ran during ``run()`` (inner commands of scripts included)."""
    client.config_resetstat()
    run()
    stats = client.info("commandstats")
    out: Counter[str] = Counter()
    for name, value in stats.items():
        command = name[len("cmdstat_"):]
        if command not in ("info", "config|resetstat"):
            out[command] = int(value["calls"])
    return out


def take(engine: LockEngine, keys: LockKeys, task_id: str, done: bool = False) -> object:
    """An acquire as SingletonTask makes it (``done``: the task has a done window)."""
    return engine.acquire(keys, Request(task_id=task_id, exec_id=f"e-{task_id}",
                                        lease=Lease.of_ms(30_000), hostname="w1@host", retries=0,
                                        task_name="t.count",
                                        done=done))


@pytest.mark.parametrize("done", [False, True], ids=["default", "done_window"])
def test_a_task_costs_three_script_calls_and_thirteen_commands_inside_redis(server, done):
    """The fencing counter is written and read back in one SET ... GET; the
    done marker is read only by a task that keeps a done window."""
    engine = engine_on(server)
    pairs = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex)
             for _ in range(ROUNDS + 1)]
    keys, task_id = pairs.pop()
    take(engine, keys, task_id)  # connection made, scripts loaded
    engine.release(keys, f"e-{task_id}", task_id)

    def run() -> None:
        for keys, task_id in pairs:
            assert take(engine, keys, task_id, done).status is Acquire.GRANTED
            assert engine.release(keys, f"e-{task_id}", task_id)

    got = counted(server.client(), run)
    expected = Counter(TASK_COMMANDS)
    if done:
        expected.update(DONE_WINDOW_EXTRA)
    assert dict(got) == {c: n * ROUNDS for c, n in expected.items()}


def test_a_skipped_duplicate_costs_one_script_call_and_one_read(server):
    engine = engine_on(server)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    take(engine, keys, "holder")

    def run() -> None:
        for _ in range(ROUNDS):
            assert take(engine, keys, uuid.uuid4().hex).status is Acquire.HELD

    got = counted(server.client(), run)
    assert dict(got) == {c: n * ROUNDS for c, n in SKIP_COMMANDS.items()}


def test_the_usual_calls_pass_few_strings(server):
    """Redis pays for each string passed about as much as for a command run: the
    usual acquire passes three keys and seven strings (the last three, the
    fencing counter's TTL, the request's deadline and when the grant expires
    unless confirmed), its confirmation two and three
    (renew.lua: the counter's retention, the execution id, the lease), the
    usual release two and one."""
    engine = engine_on(server)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    client = server.client()
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    take(engine, keys, "t1")
    engine.release(keys, "e-t1", "t1")
    calls = [e["command"] for e in client.slowlog_get(10)
             if str(e["command"]).upper().startswith(("EVALSHA", "B'EVALSHA"))]
    lengths = sorted(len(str(c).split(" ")) for c in calls)
    # EVALSHA sha numkeys + keys + args
    assert lengths == [3 + 2 + 1, 3 + 2 + 3, 3 + 3 + 7], calls


def test_the_owner_record_is_one_string_in_the_documented_order(server):
    engine = engine_on(server)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    token = engine.acquire(keys, Request(task_id="a\nb", exec_id="e-1", lease=Lease.of_ms(30_000),
                                         hostname="w1@host", retries=0,
                                         task_name="t.count")).token
    client = server.client()
    assert client.type(keys.lock) == "string"
    record = owner_record(client, keys.lock)
    assert record["task"] == "a\nb" and record["exec"] == "e-1"
    assert int(record["token"]) == token and record["host"] == "w1@host"
    assert record["name"] == "t.count" and record["lease"] == "30000"
    other = take(engine, keys, "a")
    assert other.status is Acquire.HELD and other.holder.task_id == "a\nb"  # type: ignore[attr-defined]
    doc = (ROOT / "docs" / "redis-keys.md").read_text()
    assert "`" + "`, `".join(RECORD_FIELDS) + "`" in doc
