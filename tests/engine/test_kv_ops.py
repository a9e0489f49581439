"""The plain key and hash operations every engine offers (``Engine.read``,
``write``, ``take``, ``present``, ``read_hash``, ``update_hash``,
``run_script``): beat, the statistics and the CLI reach the lock Redis only
through them, so each deployment kind answers them alike, as text.
"""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine.base import Engine
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.scripts import Script
from tests.deployments import Cluster
from tests.support import RedisServer

KINDS = ("one server", "cluster", "redlock")


@pytest.fixture(scope="module", params=KINDS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    kind = request.param
    if kind == "cluster":
        cluster = Cluster(primaries=3).start()
        url, stop = cluster.url(), cluster.cleanup
    else:
        servers = [RedisServer().start() for _ in range(1 if kind == "one server" else 3)]
        url = (servers[0].url(2) if kind == "one server" else
               "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in servers) + "/2")

        def stop() -> None:
            for s in servers:
                s.cleanup()
    e = connect(SingletonConfig.defaults(url))
    yield e
    e.close()
    stop()


def test_write_read_take_and_present_answer_text(engine: Engine) -> None:
    key = f"singleton:kv:{uuid.uuid4().hex}"
    assert engine.read(key) is None and not engine.present(key)
    assert engine.write(key, "1700000000000", 60_000, previous=True) is None
    assert engine.read(key) == "1700000000000" and engine.present(key)
    # the value it replaced, as text (redis-py makes SET's reply a bool unless told)
    assert engine.write(key, "1700000001000", 60_000, previous=True) == "1700000000000"
    assert engine.write(key, "x", 60_000) is None
    assert engine.take(key) == "x"
    assert engine.take(key) is None and not engine.present(key)


def test_a_written_key_ends_with_its_ttl(engine: Engine) -> None:
    key = f"singleton:kv:{uuid.uuid4().hex}"
    engine.write(key, "v", 1)
    # a 1 ms TTL: gone on the next read that comes after it (no sleep raced)
    for _ in range(1000):
        if engine.read(key) is None:
            break
    assert engine.read(key) is None


def test_hash_updates_add_put_and_drop_in_one_call(engine: Engine) -> None:
    key = f"singleton:kvh:{uuid.uuid4().hex}"
    assert engine.read_hash(key) == {}
    engine.update_hash(key, add={"n": 2, "f": 0.5}, put={"who": "w1@h"}, ttl_s=60)
    engine.update_hash(key, add={"n": 3, "f": 0.25}, drop=["who"])
    got = engine.read_hash(key)
    assert got.keys() == {"n", "f"} and got["n"] == "5" and float(got["f"]) == 0.75


def test_a_script_runs_by_sha_even_where_it_was_never_loaded(engine: Engine) -> None:
    """beat's buffer_all scripts: the first call on a fresh server loads it."""
    from celery_singleton_lock.beat.overlap import _TAKE
    from celery_singleton_lock.beat.ticks import last_sent_key, queue_key

    assert isinstance(_TAKE, Script)
    name = f"e-{uuid.uuid4().hex}"
    keys = [queue_key("singleton:", name), last_sent_key("singleton:", name)]
    assert engine.run_script(_TAKE, keys, ["", 30_000]) == -1  # nothing waits
    engine.write(keys[1], "1000", 30_000)
    assert engine.run_script(_TAKE, keys, ["", 30_000]) == 0  # another beat sent one


def test_a_claim_is_won_once_kept_by_its_claimant_and_given_up_only_by_it(
        engine: Engine) -> None:
    """``claim`` (a beat's tick, a worker's run marker): the first claimant
    wins, and wins again (its own retry); another is refused and told who
    holds it; ``unclaim`` frees it for its holder only; a claim ends with its
    TTL."""
    key = f"singleton:kv:{uuid.uuid4().hex}"
    assert engine.claim(key, "beat-a", 60_000) == (True, "beat-a")
    assert engine.claim(key, "beat-a", 60_000) == (True, "beat-a")
    assert engine.claim(key, "beat-b", 60_000) == (False, "beat-a")
    assert engine.unclaim(key, "beat-b") is False and engine.read(key) == "beat-a"
    assert engine.unclaim(key, "beat-a") is True and engine.read(key) is None
    assert engine.claim(key, "beat-b", 60_000) == (True, "beat-b")
    brief = f"singleton:kv:{uuid.uuid4().hex}"
    assert engine.claim(brief, "beat-a", 1) == (True, "beat-a")
    # a 1 ms TTL: gone on a read that comes after it (no sleep raced)
    for _ in range(1000):
        if engine.read(brief) is None:
            break
    assert engine.read(brief) is None
