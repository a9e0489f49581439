"""The lock across a real network that fails: two prefork workers reach the
lock Redis over a path of their own (a network namespace, :mod:`tests.netns`)
that is cut for a while, or drops a share of its packets; the broker and the
test's events stay on loopback.

A call that times out in the fault may reach Redis later (a kernel resends it,
a link delivers it late): its request carries a deadline and writes nothing
then, and a grant whose reply was lost expires by itself unless its holder
confirms it. So, through and after the fault: every call runs or is skipped
(none lost or failed), no two runs of one key overlap, tokens go up, and no
call is skipped against a holder that was not running then: one that never
ran, or had ended more than a second before (its release, owed through the
fault, goes out as soon as the path is back). The lock Redis's ``MONITOR``,
read over the test's own path, gives every grant with its request's deadline:
none is made after it (a grant to a call that had already timed out), and the
grants no run started under (a reply lost) are counted. Each test prints a
line of these figures.

The default run cuts the path for 5 s and drops 20 % of its packets for 8 s;
``NET_PARTITION_SECONDS`` and ``NET_LOSS_SECONDS`` set them (the figures in
docs/reliability.md: 20 s and 60 s).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

from celery_singleton_lock.engine.calls import SCRIPTS
from tests.netns import IsolatedRedis
from tests.support import HoldLoad, Worker, discard
from tests.workerapp import make_app

PARTITION_SECONDS = float(os.environ.get("NET_PARTITION_SECONDS", "5"))
LOSS_SECONDS = float(os.environ.get("NET_LOSS_SECONDS", "8"))
#: calls of a few keys, 50-250 ms each, one every 50 ms, over two workers
CONF = {"singleton_ttl": 30.0}
#: the grant script (Redis 7.0 runs no native grant): MONITOR shows its own
#: commands right after its EVALSHA
ACQUIRE = SCRIPTS["acquire"].sha


@dataclass
class Grant:
    """A lock the server granted (acquire.lua's SET of a new owner record)."""

    task: str
    token: int
    #: the server's clock when it granted (µs), and its request's deadline
    #: (ms; 0: none): the moment, on that clock, its caller gave up waiting
    at_us: int
    deadline_ms: int
    #: how long the lock was set to live unless its holder confirmed it (ms)
    ttl_ms: int


def _server_side(lines: list[tuple[float, str, list[str]]], calls: set[str]
                 ) -> tuple[list[Grant], int]:
    """The grants to ``calls`` (task ids) in a MONITOR record of the lock
    Redis, and how many of their requests reached it after their deadline
    (refused: {8, ms})."""
    grants, late = [], 0
    request: list[str] = []
    for t, client, args in lines:
        if client != "lua":
            request = args if args[:2] == ["EVALSHA", ACQUIRE] else []
            if request and request[3 + int(request[2])] not in calls:
                request = []  # not the load's (the workers' start-up checks)
            if request and 0 < int(request[-2]) < t * 1000:
                late += 1
            continue
        if not request or args[:2] != ["SET", request[3]] or args[3:4] != ["PX"]:
            continue
        fields = args[2].split("\n")
        grants.append(Grant(task=fields[-1], token=int(fields[3]), at_us=int(fields[4]),
                            deadline_ms=int(request[-2]), ttl_ms=int(args[4])))
    return grants, late


@pytest.fixture
def lock_redis() -> Iterator[IsolatedRedis]:
    server = IsolatedRedis().start()
    yield server
    server.cleanup()


def _run(redis_server: Any, lock_redis: IsolatedRedis, fault: Callable[[], None],
         heal: Callable[[], None], seconds: float, seed: int
         ) -> tuple[HoldLoad, float, list[tuple[float, str, list[str]]]]:
    """The load before, through and after ``fault`` (``seconds`` long); the
    load, when the path was healed (wall clock, as the events') and every
    command the lock Redis ran meanwhile."""
    queue = f"net-{uuid.uuid4().hex[:8]}"
    monitor = lock_redis.monitor()
    workers = [Worker(redis_server.url(), queue, concurrency=2, lock_url=lock_redis.url(2),
                      conf=CONF, name=n).start() for n in ("a", "b")]
    try:
        app = make_app(redis_server.url(), queue, lock_url=lock_redis.url(2), conf=CONF)
        load = HoldLoad(app.tasks["t.hold"], [f"k{n}-{seed}" for n in range(4)], seed,
                        seconds=(0.05, 0.25))
        phases = ((3.0, None), (seconds, fault), (4.0, heal))
        healed = 0.0
        for length, start in phases:
            if start is not None:
                start()
                healed = time.time()
            began = time.monotonic()
            while time.monotonic() - began < length:
                load.step()
        load.drain(120)
        return load, healed, monitor.stop()
    finally:
        for w in workers:
            discard(w)
        monitor.stop()


def _check(load: HoldLoad, events: Any, healed: float,
           lines: list[tuple[float, str, list[str]]], what: str) -> None:
    starts, ends = events.starts("load"), events.ends("load")
    history = "\n".join(f"{e['t']:.3f} {e['ev']} {e['key']} {e['id']} token={e['token']}"
                        for e in sorted(starts + ends, key=lambda e: e["t"]))
    overlaps = [e for e in starts if e["concurrent"] > 1]
    assert overlaps == [], f"{what}: runs of one key overlapped\n{history}"
    tokens: dict[str, list[int]] = defaultdict(list)
    for e in sorted(starts, key=lambda e: e["t"]):
        tokens[e["key"]].append(e["token"])
    assert all(a < b for t in tokens.values() for a, b in zip(t, t[1:])), \
        f"{what}: a token did not go up\n{history}"
    failed = [res.result for res, _ in load.ready if res.state == "FAILURE"]
    assert failed == [], f"{what}: calls failed: {failed[:5]}"
    calls = {res.id for res, _ in load.ready}
    grants, late = _server_side(lines, calls)
    after = [g for g in grants if g.deadline_ms and g.at_us // 1000 > g.deadline_ms]
    assert after == [], f"{what}: granted after the caller gave up: {after}\n{history}"
    ran = {(e["id"], int(e["token"])) for e in starts}
    unheld = [g for g in grants if (g.task, g.token) not in ran]
    wrong = load.skips_while_not_running(starts + ends, healed)
    assert wrong == [], (f"{what}: skipped against holders not running then (healed at "
                         f"{healed:.3f}):\n" + "\n".join(wrong) + f"\n{history}\n"
                         f"grants nobody ran under: {unheld}")
    skipped = len(load.skips())
    print(f"\n{what}: {len(load.ready)} calls, {len(starts)} ran, {skipped} skipped; "
          f"{len(grants)} grants, 0 made after their caller gave up, {len(unheld)} nobody ran "
          f"under; {late} grant requests came after their caller gave up (refused); "
          f"0 overlaps, 0 skipped against a holder not running then")
    for g in unheld:  # a reply lost: the grant expires by itself
        print(f"  nobody ran under {g.task} token={g.token}: granted "
              f"{g.at_us / 1e6 - healed:+.3f} s from the heal, "
              f"{g.deadline_ms - g.at_us // 1000} ms before its deadline, "
              f"set to live {g.ttl_ms} ms unless confirmed")


@pytest.mark.worker
@pytest.mark.timeout(PARTITION_SECONDS + 240)
def test_a_partition_of_both_workers_from_the_lock_redis(redis_server, events, lock_redis):
    """Both workers cut off from the lock Redis for a while mid-load: calls
    meanwhile fail at once and are retried (default ``singleton_on_backend_error``),
    nothing runs twice at once, and nothing is skipped against a holder that
    never ran or had ended."""
    load, healed, lines = _run(redis_server, lock_redis, lock_redis.cut, lock_redis.heal,
                               PARTITION_SECONDS, seed=5)
    _check(load, events, healed, lines, f"a {PARTITION_SECONDS:g} s partition")


@pytest.mark.worker
@pytest.mark.timeout(LOSS_SECONDS + 240)
def test_a_path_that_drops_a_fifth_of_its_packets(redis_server, events, lock_redis):
    """20 % of the packets between the workers and the lock Redis dropped, each
    way, for a while mid-load: calls time out now and then, their requests
    may arrive after their callers gave up, and replies get lost; still no
    overlap, no call lost, and no skip against a holder that never ran or had
    ended."""
    load, healed, lines = _run(redis_server, lock_redis, lambda: lock_redis.lose(20),
                               lock_redis.heal, LOSS_SECONDS, seed=6)
    _check(load, events, healed, lines, f"20 % loss for {LOSS_SECONDS:g} s")
