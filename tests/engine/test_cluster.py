"""Redis Cluster: the engine against a real three-primary cluster of the
module's own (``redis-cli --cluster create``): slots, nodes, migrations, a
primary restarted empty. The core promises through real workers on a cluster
are the contract suite's (``tests/contract/test_contract.py``).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from typing import Any, Iterator

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.cluster import ClusterWire, slot_of
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Release, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.engine.watch import ClusterWatch
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.lock import SingletonLock
from celery_singleton_lock.worker.heartbeat import Heartbeat
from celery_singleton_lock.worker.ticks import ENTRY_HEADER, TICK_HEADER, claim_tick_run
from tests.deployments import Cluster
from tests.support import (
    RedisServer,
    owner_field,
    owner_record,
    wait_for,
    write_owner,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(primaries=3).start()
    yield c
    c.cleanup()


@pytest.fixture
def engine(cluster: Cluster) -> Iterator[LockEngine]:
    e = connect(SingletonConfig.defaults(cluster.url()))
    yield e
    assert isinstance(e.wire, ClusterWire)
    e.wire.close()


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str = "",
         done: bool = True, lease_ms: int = 5000) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id or uuid.uuid4().hex,
                                        lease=Lease.of_ms(lease_ms), hostname="w1@host",
                                        retries=0, task_name="t.x", done=done))


def test_each_lock_lives_in_one_slot_and_locks_spread_over_every_primary(cluster, engine):
    """All five keys of a lock hash to one slot; grants land on the node owning
    that slot; 30 locks use all three primaries; a second task is refused."""
    owners = set()
    for i in range(30):
        keys = new_keys()
        assert len({slot_of(k) for k in (keys.lock, keys.fence, keys.fin, keys.queued,
                                         keys.done)}) == 1
        # a minute's lease: the look at its node between the two takes makes a
        # client of its own, which on a loaded machine took longer than 5 s
        assert take(engine, keys, f"t{i}", lease_ms=60_000).status is Acquire.GRANTED
        node = cluster.node_of(keys.lock)
        assert owner_field(node.client(), keys.lock, "task") == f"t{i}"
        owners.add(node.port)
        assert take(engine, keys, "other").status is Acquire.HELD
    assert len(owners) == 3
    # each node is reached on its own connections, made once
    assert engine.wire.connections <= 3 * 2


def test_one_renewal_round_renews_locks_of_every_slot_without_crossslot(cluster, engine):
    """A renewal of 40 locks in 40 slots on 3 nodes: every lease extended, one
    call per slot, no CROSSSLOT; a lock taken over by another execution answers
    NOT_OURS and an absent one ABSENT, in the right places."""
    entries = []
    for i in range(40):
        keys, exec_id = new_keys(), uuid.uuid4().hex
        take(engine, keys, f"t{i}", exec_id)
        entries.append((keys.lock, exec_id, 20_000))
    stolen = entries[5][0]
    write_owner(cluster.node_of(stolen).client(), stolen, exec="someone-else")
    entries.append((new_keys().lock, "nobody", 20_000))
    results = engine.renew(entries)
    assert results[5] is Renew.NOT_OURS and results[-1] is Renew.ABSENT
    assert all(r is Renew.RENEWED for i, r in enumerate(results[:-1]) if i != 5)
    ttl = cluster.node_of(entries[0][0]).client().pttl(entries[0][0])
    assert 15_000 < ttl <= 20_000


def test_a_release_sent_without_waiting_is_answered_on_its_node(cluster, engine):
    keys, exec_id = new_keys(), uuid.uuid4().hex
    take(engine, keys, "t1", exec_id)
    answers: list[Any] = []
    engine.release_later(keys, exec_id, "t1", lambda reply, error: answers.append(reply))
    engine.settle()
    assert answers[0].status is Release.RELEASED
    assert not cluster.node_of(keys.lock).client().exists(keys.lock)


def migrate_slot(cluster: Cluster, slot: int, source: RedisServer, target: RedisServer) -> None:
    """Move one slot with its keys (what ``redis-cli --cluster reshard`` does)."""
    half_migrate_slot(slot, source, target)
    finish_migration(cluster, slot, source, target)


def half_migrate_slot(slot: int, source: RedisServer, target: RedisServer) -> None:
    """The first half of a reshard: ``target`` importing ``slot``, ``source``
    migrating it, every key of the slot moved; the slot still ``source``'s in
    every node's map, so ``source`` answers ASK for the keys it no longer has."""
    src, dst = source.client(), target.client()
    src_id = src.execute_command("CLUSTER", "MYID")
    dst_id = dst.execute_command("CLUSTER", "MYID")
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)


def finish_migration(cluster: Cluster, slot: int, source: RedisServer,
                     target: RedisServer) -> None:
    """The second half: any key written on ``source`` meanwhile moved too, then
    the slot given to ``target`` on every node."""
    src = source.client()
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    dst_id = target.client().execute_command("CLUSTER", "MYID")
    for node in cluster.nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_a_slot_migrated_under_a_held_lock_is_followed_on_the_next_call(cluster, engine):
    """The slot of a held lock moves to another primary while it is held: the
    next renewal and the release follow MOVED to the new owner (slot map read
    again), the lock stays this execution's and the key ends up freed."""
    keys, exec_id = new_keys(), uuid.uuid4().hex
    first = take(engine, keys, "t1", exec_id)
    source = cluster.node_of(keys.lock)
    target = next(n for n in cluster.nodes if n.port != source.port)
    migrate_slot(cluster, slot_of(keys.lock), source, target)
    assert owner_field(target.client(), keys.lock, "exec") == exec_id
    assert engine.renew([(keys.lock, exec_id, 5000)]) == [Renew.RENEWED]
    assert take(engine, keys, "t2").status is Acquire.HELD
    assert engine.release(keys, exec_id, "t1") is True
    later = take(engine, keys, "t3")
    assert later.status is Acquire.GRANTED and later.token > first.token
    assert owner_field(target.client(), keys.lock, "task") == "t3"


def asking_calls(node: RedisServer) -> int:
    """How many ``ASKING`` commands ``node`` has run (``INFO commandstats``)."""
    return int(node.client().info("commandstats").get("cmdstat_asking", {}).get("calls", 0))


class Importing:
    """Reads on a node importing a slot: each command after ``ASKING`` on
    one connection (without it the node answers MOVED to the slot's owner)."""

    def __init__(self, node: RedisServer) -> None:
        self.node = node

    def _asking(self, *command: Any) -> Any:
        pipe = self.node.client().pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command(*command)
        return pipe.execute()[1]

    def get(self, key: str) -> Any:
        return self._asking("GET", key)

    def pttl(self, key: str) -> int:
        return int(self._asking("PTTL", key))


def test_a_half_migrated_slot_is_followed_by_ask_to_the_importing_node(cluster, engine):
    """A held lock's slot is half migrated (the target importing it, the source
    migrating it, every key moved, the slot still the source's in the map), so
    the source answers ASK: a renewal, a duplicate's acquire and the release
    each go once to the importing node after ``ASKING``, without reading the
    slot map again, and act there as on any node (renewed there, HELD, a
    stranger's renewal NOT_OURS, released there). Every key the calls name
    exists on the target (an earlier run's release recorded its finish,
    ``fin``; the duplicate's task keeps no done window): Redis answers TRYAGAIN
    to an ASKING call naming several keys when one is missing."""
    keys = new_keys()
    before = take(engine, keys, "t0", "e0")
    assert engine.release(keys, "e0", "t0", always_record=True) is True  # writes :fin
    exec_id = uuid.uuid4().hex
    first = take(engine, keys, "t1", exec_id)
    assert first.status is Acquire.GRANTED and first.token > before.token
    source = cluster.node_of(keys.lock)
    target = next(n for n in cluster.nodes if n.port != source.port)
    slot, on_target = slot_of(keys.lock), Importing(target)
    assert isinstance(engine.wire, ClusterWire)
    half_migrate_slot(slot, source, target)
    try:
        # another test's lock may share the slot (one in 16,384): only this one's keys
        moved = target.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        assert sorted(k for k in moved if k.startswith(keys.base + ":")) \
            == sorted([keys.lock, keys.fence, keys.fin])
        version = engine.wire.map_version

        def once_on_target(call: Any) -> Any:
            asked = asking_calls(target)
            answer = call()
            assert asking_calls(target) == asked + 1
            return answer

        assert once_on_target(lambda: engine.renew([(keys.lock, exec_id, 60_000)])) \
            == [Renew.RENEWED]
        assert on_target.pttl(keys.lock) > 5000  # take()'s lease was 5 s
        assert once_on_target(lambda: engine.renew([(keys.lock, "a-stranger", 60_000)])) \
            == [Renew.NOT_OURS]
        # no done window: the acquire names the lock, its fence and its fin only
        assert once_on_target(lambda: take(engine, keys, "t2", done=False)).status \
            is Acquire.HELD
        assert owner_field(on_target, keys.lock, "exec") == exec_id
        assert once_on_target(lambda: engine.release(keys, exec_id, "t1", always_record=True))
        assert on_target.get(keys.lock) is None
        assert on_target.get(keys.fin) == "t1"
        assert not source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
        # ASK is for one call: the slot map still gives the slot to the source
        assert engine.wire.map_version == version
        assert engine.wire.wire_for(keys.lock).name.endswith(f":{source.port}")
    finally:
        finish_migration(cluster, slot, source, target)
    later = take(engine, keys, "t3")
    assert later.status is Acquire.GRANTED and later.token > first.token
    assert owner_field(target.client(), keys.lock, "task") == "t3"


def test_a_release_refused_in_a_half_migrated_slot_frees_the_key_once_it_moved(cluster,
                                                                             engine):
    """The usual release names the lock and its ``fin`` key, which does not
    exist: in a half-migrated slot the importing node answers its ASKING call
    TRYAGAIN (docs/deployments.md, slot migration). The release fails as a
    Redis error, is owed to the slot, and frees the key once the move
    completes, long before its lease (renewed to a minute) would."""
    keys, exec_id = new_keys(), uuid.uuid4().hex
    first = take(engine, keys, "t1", exec_id, done=False)
    source = cluster.node_of(keys.lock)
    target = next(n for n in cluster.nodes if n.port != source.port)
    slot = slot_of(keys.lock)
    assert isinstance(engine.wire, ClusterWire)
    half_migrate_slot(slot, source, target)
    try:
        assert engine.renew([(keys.lock, exec_id, 60_000)]) == [Renew.RENEWED]
        with pytest.raises(redis.exceptions.TryAgainError):
            engine.release(keys, exec_id, "t1")
        assert engine.wire.owed == 1
        assert owner_field(Importing(target), keys.lock, "exec") == exec_id
    finally:
        finish_migration(cluster, slot, source, target)
    wait_for(lambda: engine.wire.owed == 0, 20, what="the owed release sent")
    assert not target.client().exists(keys.lock)
    later = take(engine, keys, "t2", done=False)
    assert later.status is Acquire.GRANTED and later.token > first.token


def test_tick_claims_go_to_the_node_of_their_key(cluster, engine):
    """A beat tick's run claim through the engine's cluster client: the first
    task id of a tick runs, another id for the same tick is dropped, the same
    id again (a retry) runs."""
    tick = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.timezone.utc).isoformat()
    req = {ENTRY_HEADER: "nightly", TICK_HEADER: tick, "id": "a"}
    assert claim_tick_run(engine, "singleton:", req) is True
    assert claim_tick_run(engine, "singleton:", {**req, "id": "b"}) is False
    assert claim_tick_run(engine, "singleton:", req) is True


def test_a_beats_permission_probes_run_on_one_node_and_leave_nothing(cluster, engine):
    """The start-up check of a beat with every overlap mode, through the cluster
    client: each probe reaches the node of its key, none is refused (the
    default user), and the one DEL that frees them finds both on one node."""
    from celery_singleton_lock.checks.permissions import BEAT_COMMANDS, beat_denied

    assert beat_denied(engine.client, "singleton:", list(BEAT_COMMANDS)) == []
    for node in cluster.nodes:
        assert not node.client().keys("singleton:probe:*"), node.port


def test_a_primary_restarted_empty_gets_its_held_locks_back_at_once(cluster, engine):
    """The renewer watches every primary, not only one: a primary other than
    slot 0's restarts empty under two held locks; they are written back at once
    with higher tokens (the next round is 10 s away), while a lock on another
    primary whose key an operator deleted meanwhile is not taken back."""
    assert isinstance(engine.wire, ClusterWire)
    zero = int(engine.wire.wire_for_slot(0).name.rsplit(":", 1)[1])
    by_node: dict[int, list[LockKeys]] = {}
    while not (zero in by_node and any(
            len(ks) >= 2 for port, ks in by_node.items() if port != zero)):
        keys = new_keys()
        by_node.setdefault(cluster.node_of(keys.lock).port, []).append(keys)
    victim_port = next(port for port, ks in by_node.items() if port != zero and len(ks) >= 2)
    on_other, elsewhere = by_node[victim_port][:2], by_node[zero][0]
    victim = next(n for n in cluster.nodes if n.port == victim_port)
    hb = Heartbeat(engine)
    locks = []
    for keys in [*on_other, elsewhere]:
        exec_id = uuid.uuid4().hex
        got = take(engine, keys, "t-" + exec_id[:6], exec_id)
        locks.append(SingletonLock(keys, task_id="t-" + exec_id[:6], task_name="t.x",
                                   exec_id=exec_id, token=got.token, lease=30.0,
                                   started=time.monotonic(), held=True, hostname="w1@host"))
        hb.add(locks[-1])
    try:
        assert isinstance(hb.watch, ClusterWatch)
        wait_for(lambda: len(hb.watch.watches) == 3 and all(
            w.run_id for w in hb.watch.watches.values()), 5, what="a watch on every primary")
        cluster.node_of(elsewhere.lock).client().delete(elsewhere.lock)  # an operator frees it
        victim.stop()
        victim.start()  # same port and cluster config, no data
        wait_for(cluster.ok, 20, interval=0.1, what="the cluster whole again")
        wait_for(lambda: all(victim.client().exists(lock.keys.lock) for lock in locks[:2]), 8,
                 what="both locks back on the restarted primary")
        for lock in locks[:2]:
            record = owner_record(victim.client(), lock.keys.lock)
            assert record["exec"] == lock.exec_id and int(record["token"]) > lock.token
            assert not lock.lost
        assert hb.reasserted == 2
        assert not cluster.node_of(elsewhere.lock).client().exists(elsewhere.lock)
        wait_for(lambda: locks[2].lost, 15, what="the freed lock seen lost at its next round")
    finally:
        for lock in locks:
            hb.discard(lock)
        hb.watch.close()


def test_a_round_one_primary_does_not_answer_leaves_its_locks_held(cluster):
    """A renewal round in which one primary is silent (frozen, SIGSTOP) renews
    the locks of the others and leaves the silent one's alone, as on any Redis
    error (their own deadlines decide if it lasts): none is marked lost, and
    the round reports that it did not get through, so the next comes soon.
    Once the primary answers again the next round renews them all."""
    engine = connect(SingletonConfig.defaults(cluster.url(),
                                              redis_options={"socket_timeout": 0.5}))
    assert isinstance(engine.wire, ClusterWire)
    by_port: dict[int, LockKeys] = {}
    while len(by_port) < 2:
        keys = new_keys()
        by_port.setdefault(cluster.node_of(keys.lock).port, keys)
    (_, keys_a), (silent_port, keys_b) = list(by_port.items())
    silent = next(n for n in cluster.nodes if n.port == silent_port)
    hb = Heartbeat(engine)
    locks = []
    for keys in (keys_a, keys_b):
        exec_id = uuid.uuid4().hex
        got = take(engine, keys, "t-" + exec_id[:6], exec_id, lease_ms=60_000)
        assert got.status is Acquire.GRANTED
        locks.append(SingletonLock(keys, task_id="t-" + exec_id[:6], task_name="t.x",
                                   exec_id=exec_id, token=got.token, lease=120.0,
                                   started=time.monotonic(), held=True, hostname="w1@host",
                                   confirmation=got.confirmation))
        hb.add(locks[-1])
    # each grant's confirmation (sent without waiting) read before the pause:
    # one still on its way when the primary froze reaches it past the grant's
    # window (1 s here), finds the key gone and its holder in doubt, as
    # tests/engine/test_late_requests.py shows, which is not this round
    engine.settle()
    assert not locks[0].confirming and not locks[1].confirming
    try:
        # 60 s leases from take() (a pause and the cluster's rejoin fit in them
        # on a loaded machine): a round that got through makes them 120 s
        silent.pause()
        try:
            assert hb.renew_now() is False
        finally:
            silent.resume()
        assert not locks[0].lost and not locks[1].lost
        assert locks[0].held and locks[1].held
        assert cluster.node_of(keys_a.lock).client().pttl(keys_a.lock) > 60_000
        wait_for(cluster.ok, 20, interval=0.1, what="the cluster whole again")
        wait_for(hb.renew_now, 20, interval=0.1, what="a round that gets through")
        assert silent.client().pttl(keys_b.lock) > 60_000
        assert owner_field(silent.client(), keys_b.lock, "exec") == locks[1].exec_id
        assert not locks[1].lost
    finally:
        for lock in locks:
            hb.discard(lock)
        hb.watch.close()
        engine.wire.close()
