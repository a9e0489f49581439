"""Redis Cluster with replicas: WAIT on every node, and a primary failing over.

Three primaries, one replica each, a node timeout of one second: a primary
killed with ``kill -9`` is replaced by its replica within a few seconds. The
lock Redis is the cluster; the broker and the test events stay on the
session's standalone server.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, Iterator, Optional

import pytest
import redis

from celery_singleton_lock import SingletonConfig, is_skipped
from celery_singleton_lock.engine.cluster import ClusterWire, slot_of
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.exceptions import TooFewReplicasError
from celery_singleton_lock.keys import LockKeys
from tests.deployments import Cluster
from tests.support import HoldLoad, RedisServer, Worker, discard, wait_for
from tests.workerapp import make_app


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(primaries=3, replicas=1, node_timeout_ms=1000).start()
    yield c
    c.cleanup()


def engine_on(cluster: Cluster, **conf: Any) -> LockEngine:
    return connect(dataclasses.replace(SingletonConfig.defaults(cluster.url()),
                                                      **conf))


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str) -> Any:
    return engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id,
                                        lease=Lease.of_ms(30_000), hostname="w1@host", retries=0,
                                        task_name="t.x"))


def primary_of(cluster: Cluster, slot: int) -> Optional[RedisServer]:
    """The node serving ``slot`` now, as any running node sees the map."""
    return cluster.primary_of(slot)


def on_replica(cluster: Cluster, key: str) -> bool:
    """The key has reached a replica of the primary that owns it."""
    for node in cluster.nodes:
        conn = redis.Redis(port=node.port, single_connection_client=True,
                           decode_responses=True)
        try:
            if conn.info("replication").get("role") != "slave":
                continue
            conn.execute_command("READONLY")
            if conn.exists(key):
                return True
        except redis.RedisError:
            continue
        finally:
            conn.close()
    return False


def test_renewals_send_wait_to_every_node_and_say_when_replicas_fall_short(cluster, caplog):
    """WAIT follows the renewals of each node on the same connection: with one
    replica asked for, 30 locks over every primary renew without a warning and
    every key is on a replica; asking for two (there is one per primary) still
    renews them all, and the log names each node that fell short."""
    one = engine_on(cluster, wait_replicas=1, wait_timeout=500)
    two = engine_on(cluster, wait_replicas=2, wait_timeout=50)
    try:
        entries = []
        for i in range(30):
            keys, exec_id = new_keys(), uuid.uuid4().hex
            assert take(one, keys, f"t{i}", exec_id).status is Acquire.GRANTED
            entries.append((keys.lock, exec_id, 20_000))
        nodes = {primary_of(cluster, slot_of(e[0])).port for e in entries}  # type: ignore[union-attr]
        assert len(nodes) == 3
        with caplog.at_level(logging.WARNING, logger="celery_singleton_lock"):
            assert one.renew(entries) == [Renew.RENEWED] * 30
            assert not [r for r in caplog.records if "replicas acknowledged" in r.getMessage()]
            assert all(on_replica(cluster, e[0]) for e in entries)
            assert two.renew(entries) == [Renew.RENEWED] * 30
        short = [r.getMessage() for r in caplog.records
                 if "fewer than 2 replicas acknowledged" in r.getMessage()]
        assert len(short) == 1 and all(f":{port}" in short[0] for port in nodes)
    finally:
        for e in (one, two):
            assert isinstance(e.wire, ClusterWire)
            e.wire.close()


def test_a_primary_killed_under_a_held_lock_fails_over_and_the_lock_stays(cluster):
    """A lock granted with WAIT 1, then its primary is killed: once the replica
    is promoted the same engine renews it there (no restart, no new engine),
    another execution is refused; the old primary rejoins as a replica, the
    release frees the lock and the next grant's token is higher."""
    engine = engine_on(cluster, wait_replicas=1, wait_timeout=500)
    keys, exec_id = new_keys(), uuid.uuid4().hex
    first = take(engine, keys, "t1", exec_id)
    assert first.status is Acquire.GRANTED
    slot = slot_of(keys.lock)
    old = primary_of(cluster, slot)
    assert old is not None
    old.stop()  # kill -9

    def renewed() -> bool:
        try:
            return engine.renew([(keys.lock, exec_id, 30_000)]) == [Renew.RENEWED]
        except redis.RedisError:
            return False

    wait_for(renewed, 30, interval=0.2, what="the renewal to reach the promoted replica")
    new = primary_of(cluster, slot)
    assert new is not None and new.port != old.port
    assert take(engine, keys, "t2", uuid.uuid4().hex).status is Acquire.HELD
    # the old primary comes back as a replica of the new one: WAIT 1 can be met again
    old.start()
    wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")

    def replicating() -> bool:
        info = new.client().info("replication")
        return any(isinstance(v, dict) and v.get("state") == "online"
                   for k, v in info.items() if k.startswith("slave"))

    wait_for(replicating, 30, interval=0.1, what="the old primary replicating again")
    assert engine.release(keys, exec_id, "t1") is True

    def granted_again() -> Any:
        try:
            return take(engine, keys, "t3", uuid.uuid4().hex)
        except TooFewReplicasError:
            # online, but the rejoined replica did not acknowledge within 500 ms
            # (seen under load): the grant was given back; a task would retry
            return None

    later = wait_for(granted_again, 30, interval=0.2, what="a grant WAIT 1 confirms")
    assert later.status is Acquire.GRANTED and later.token > first.token
    assert isinstance(engine.wire, ClusterWire)
    engine.wire.close()


@pytest.mark.worker
def test_a_worker_keeps_its_lock_through_a_failover_and_skips_duplicates(
        cluster, redis_server, events, key):
    """A real worker holds a lock whose primary is killed mid-task: no restart,
    renewals go on on the promoted replica (a lease of 8 s outlives the 2-4 s
    failover; a round that fails is tried again every 0.5 s), a duplicate sent after the failover
    is skipped naming the holder, the task ends not lost and its key is freed."""
    conf = {"singleton_ttl": 8.0}  # no WAIT here: the default, per-slot renewal path
    worker = Worker(redis_server.url(), f"clf-{uuid.uuid4().hex[:8]}", concurrency=2,
                    lock_url=cluster.url(), conf=conf).start()
    try:
        app = make_app(redis_server.url(), worker.queue, lock_url=cluster.url(), conf=conf)
        hold = app.tasks["t.hold"]
        lock = hold.singleton_keys(key).lock
        first = hold.delay(key, 10.0, "through")
        wait_for(lambda: events.starts("through"), 15, what="start")
        # the grant has reached the replica (replication is asynchronous: a
        # grant the replica never saw is lost with its primary, as documented)
        wait_for(lambda: on_replica(cluster, lock), 10, what="the lock on the replica")
        old = primary_of(cluster, slot_of(lock))
        assert old is not None
        old.stop()

        def pttl_on_new_primary() -> int:
            node = primary_of(cluster, slot_of(lock))
            if node is None or node.port == old.port:
                return 0
            try:
                return int(node.client().pttl(lock))
            except redis.RedisError:
                return 0

        # a renewal after the failover: the lease is back near its full 8 s (the
        # promotion takes over a second, so no renewal from before it is this fresh)
        wait_for(lambda: pttl_on_new_primary() > 7200, 20, interval=0.05,
                 what="a renewal on the promoted replica")
        dup = hold.delay(key, 0.0, "dup").get(timeout=15)
        assert is_skipped(dup) and dup["holder"] == first.id
        events.client.set(f"finish:{key}", 1)  # its 10 s were to span the failover
        result = first.get(timeout=30)
        assert result["tag"] == "through" and result["lost"] is False
        assert [e["tag"] for e in events.starts()] == ["through"]
        wait_for(lambda: primary_of(cluster, slot_of(lock)) is not None
                 and not primary_of(cluster, slot_of(lock)).client().exists(lock),  # type: ignore[union-attr]
                 10, what="the key freed")
        old.start()
        wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")
    finally:
        discard(worker)


@pytest.mark.worker
def test_a_release_sent_to_a_killed_primary_reaches_the_promoted_replica(
        cluster, redis_server, events, key):
    """Twice: a task's primary is killed, then the task ends, so its release
    meets a refused connection. The release is owed to whichever node serves
    the slot, and the promoted replica frees the key as soon as it serves it:
    long before the 60 s lease, and a duplicate sent then runs instead of
    being skipped against the finished holder (before: the key stayed for the
    rest of its lease)."""
    conf = {"singleton_ttl": 60.0}
    worker = Worker(redis_server.url(), f"clr-{uuid.uuid4().hex[:8]}", concurrency=2,
                    lock_url=cluster.url(), conf=conf).start()
    gaps: list[float] = []
    try:
        app = make_app(redis_server.url(), worker.queue, lock_url=cluster.url(), conf=conf)
        hold = app.tasks["t.hold"]
        for i in range(2):
            name = f"{key}-{i}"
            lock = hold.singleton_keys(name).lock
            first = hold.delay(name, 120.0, f"ends{i}")
            wait_for(lambda t=f"ends{i}": events.starts(t), 15, what="start")
            wait_for(lambda k=lock: on_replica(cluster, k), 10, what="the lock on the replica")
            old = primary_of(cluster, slot_of(lock))
            assert old is not None
            old.stop()  # kill -9
            events.client.set(f"finish:{name}", 1)  # the task ends: its release is refused
            assert first.get(timeout=30)["lost"] is False

            def promoted(k: str = lock, was: int = old.port) -> Any:
                node = primary_of(cluster, slot_of(k))
                return node if node is not None and node.port != was else None

            new = wait_for(promoted, 30, interval=0.02, what="the replica promoted")
            promoted_at = time.monotonic()

            def freed(k: str = lock, node: RedisServer = new) -> bool:
                try:
                    return not node.client().exists(k)
                except redis.RedisError:
                    return False

            # well within the 60 s lease: only the owed release frees it this soon
            wait_for(freed, 10, interval=0.01, what="the key freed on the promoted replica")
            gaps.append(time.monotonic() - promoted_at)
            after = hold.delay(name, 0.0, f"after{i}").get(timeout=30)
            assert not is_skipped(after), after
            old.start()
            wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")
        assert "Could not release singleton lock" not in worker.logs()
        print(f"\nkey freed {', '.join(f'{g * 1000:.0f}' for g in gaps)} ms after the "
              "promoted replica first served the slot")
    finally:
        discard(worker)


def _replica_of(cluster: Cluster, primary: RedisServer) -> Optional[RedisServer]:
    for node in cluster.nodes:
        if node is primary or not node.running:
            continue
        info = node.client().info("replication")
        if info.get("role") == "slave" and int(info.get("master_port", 0)) == primary.port:
            return node
    return None


def _cluster_down(node: RedisServer) -> bool:
    text = str(node.client().execute_command("CLUSTER", "INFO"))
    return "cluster_state:fail" in text


def test_clusterdown_leaves_every_connection_in_step_and_a_release_owed(cluster):
    """WAIT 1 on a Cluster (a grant is one write: the WAIT marker's SET, the
    script, WAIT). A shard's primary and its replica are killed: the healthy
    primaries answer CLUSTERDOWN to every command until that shard is back.
    Grants meanwhile fail as Redis errors, never as a reply read off another
    call; a release answered CLUSTERDOWN is kept and sent again once the
    cluster serves the slot, so its key is free long before its 60 s lease;
    afterwards every grant and release on the same connections gets its own
    reply, and nothing is left held (before: the next grants read the earlier
    script's and WAIT's replies as their own, 'script acquire gave a reply it
    never gives: OK', and the release was dropped)."""
    from celery_singleton_lock.exceptions import UnexpectedReplyError

    engine = engine_on(cluster, wait_replicas=1, wait_timeout=500)
    victim = primary_of(cluster, 0)
    assert victim is not None
    replica = _replica_of(cluster, victim)
    assert replica is not None
    healthy: list[LockKeys] = []
    while len(healthy) < 40:
        keys = new_keys()
        node = primary_of(cluster, slot_of(keys.lock))
        if node is not None and node.port != victim.port:
            healthy.append(keys)
    held, fresh, after = healthy[0], healthy[1:20], healthy[20:]
    assert take(engine, held, "held", "e-held").status is Acquire.GRANTED
    released: list[Any] = []
    try:
        replica.stop()  # kill -9, then the primary: no one to promote
        victim.stop()
        watcher = primary_of(cluster, slot_of(held.lock))
        assert watcher is not None
        wait_for(lambda: _cluster_down(watcher), 30, interval=0.05, what="CLUSTERDOWN")
        errors = []
        for i, keys in enumerate(fresh):
            try:
                got = take(engine, keys, f"down{i}", f"e-down{i}")
            except UnexpectedReplyError:
                raise
            except redis.RedisError as exc:
                errors.append(exc)
            else:
                # the cluster may be back for this slot already: a grant of its own
                assert got.status is Acquire.GRANTED
                assert engine.release(keys, f"e-down{i}", f"down{i}") is True
        assert errors, "no grant met CLUSTERDOWN"
        engine.release_later(held, "e-held", "held", lambda r, e: released.append((r, e)),
                             finished=True)
        engine.settle()
        assert released == [], released  # refused for the failover: kept, not dropped
    finally:
        victim.start()
        replica.start()
        wait_for(cluster.ok, 60, interval=0.2, what="the cluster whole again")

    def freed() -> bool:
        node = primary_of(cluster, slot_of(held.lock))
        return node is not None and not node.client().exists(held.lock)

    wait_for(freed, 30, interval=0.05, what="the owed release to free the key (lease 60 s)")
    wait_for(lambda: bool(released), 10, what="the release's answer")
    assert released[0][1] is None, released
    tokens = []
    for i, keys in enumerate(after):
        got = wait_for(lambda k=keys, n=i: _granted(engine, k, f"after{n}"), 30,
                       interval=0.1, what="a grant WAIT 1 confirms")
        tokens.append(got.token)
        assert engine.release(keys, f"e-after{i}", f"after{i}") is True
    for node in cluster.nodes:
        if node.running and node.client().info("replication").get("role") == "master":
            left = [k for k in node.client().scan_iter(match="singleton:*:lock")
                    if any(k == h.lock for h in healthy)]
            assert left == [], f"left held on {node.port}: {left}"
    assert isinstance(engine.wire, ClusterWire)
    engine.wire.close()


def _primaries_ok(cluster: Cluster) -> bool:
    """Every running primary answers ``cluster_state:ok`` (takes writes)."""
    for node in cluster.nodes:
        if not node.running:
            continue
        try:
            client = node.client()
            if client.info("replication").get("role") != "master":
                continue
            if "cluster_state:ok" not in str(client.execute_command("CLUSTER", "INFO")):
                return False
        except redis.RedisError:
            return False
    return True


def _history(load: HoldLoad, starts: list[dict[str, Any]], ends: list[dict[str, Any]],
             shard: list[str], promoted: float, whole: Optional[float]) -> str:
    """Each call's run or skip from a second before the promotion on, by key,
    for a failure's message: times from the promotion."""
    began = {e["id"]: e["t"] for e in starts}
    ended = {e["id"]: e["t"] for e in ends}
    lines = [f"promoted at 0.00, every primary ok at "
             f"{'never' if whole is None else f'{whole - promoted:.2f}'}"]
    for res, at in sorted(load.ready, key=lambda r: r[1]):
        if at < promoted - 1:
            continue
        key = load.key_of.get(res.id, "?")
        where = "victim's shard" if key in shard else "other shard"
        if is_skipped(res.result):
            holder = res.result.get("holder", "?")
            lines.append(f"{at - promoted:6.2f} skip {res.id[:8]} {key} ({where}) held by "
                         f"{str(holder)[:8]} ran {began.get(holder, 0) - promoted:.2f}.."
                         f"{ended.get(holder, 0) - promoted:.2f}")
        elif res.id in began:
            lines.append(f"{at - promoted:6.2f} ran  {res.id[:8]} {key} ({where}) "
                         f"{began[res.id] - promoted:.2f}..{ended.get(res.id, 0) - promoted:.2f}")
        else:
            lines.append(f"{at - promoted:6.2f} {res.state} {res.id[:8]} {key} ({where})")
    return "\n".join(lines)


def _granted(engine: LockEngine, keys: LockKeys, task_id: str) -> Any:
    try:
        got = take(engine, keys, task_id, f"e-{task_id}")
    except TooFewReplicasError:
        return None  # a replica back but not yet acknowledging: a task would retry
    assert got.status is Acquire.GRANTED, got
    return got


@pytest.mark.worker
@pytest.mark.parametrize("wait", [0, 1], ids=["no-wait", "wait-1"])
def test_under_load_no_skip_against_a_finished_holder_after_the_failover(
        cluster, redis_server, events, wait):
    """Two workers, calls of four keys of one shard and four of the others sent
    every 50 ms (0.1-0.5 s each, the default 30 s lease), that shard's primary
    killed mid-run, then started again (it rejoins as a replica): the other
    primaries answer CLUSTERDOWN until the promotion, to calls pipelined with
    a WAIT marker and WAIT too (``singleton_wait_replicas=1``). No call fails
    with a reply read off another call, none is skipped against a holder that
    never ran, nor after the promotion against one that had finished more than
    a second before, and no key is left held after the drain. (Before: 1-9
    late skips per run, up to 25.5 s late; with WAIT, 11 and 18 calls FAILED
    with "script 'acquire' gave a reply it never gives: 'OK'" and two keys
    stayed held on the healthy primaries.)"""
    conf: dict[str, Any] = {"singleton_ttl": 30.0}
    if wait:
        conf.update(singleton_wait_replicas=1, singleton_wait_timeout=500)
    queue = f"cll-{uuid.uuid4().hex[:8]}"
    workers = [Worker(redis_server.url(), queue, concurrency=3, lock_url=cluster.url(),
                      conf=conf, name=n).start() for n in ("a", "b")]
    victim = primary_of(cluster, 0)
    try:
        app = make_app(redis_server.url(), queue, lock_url=cluster.url(), conf=conf)
        hold = app.tasks["t.hold"]
        assert victim is not None
        shard: list[str] = []
        others: list[str] = []
        while len(shard) < 4 or len(others) < 4:
            name = uuid.uuid4().hex[:8]
            node = primary_of(cluster, slot_of(hold.singleton_keys(name).lock))
            if node is not None:
                (shard if node.port == victim.port else others).append(name)
        keys = shard[:4] + others[:4]
        load = HoldLoad(hold, keys, 45 + wait)
        started = time.monotonic()
        while time.monotonic() - started < 3:
            load.step()
        victim.stop()  # kill -9
        while True:
            load.step()
            node = primary_of(cluster, 0)
            if node is not None and node.port != victim.port:
                promoted = time.time()
                break
            assert time.monotonic() - started < 40, "no promotion"
        victim.start()  # rejoins as the promoted one's replica
        after = time.monotonic()
        whole: Optional[float] = None  # every primary says cluster_state:ok
        while time.monotonic() - after < 6:
            load.step()
            if whole is None and _primaries_ok(cluster):
                whole = time.time()
        load.drain(90)
        failed = [res.result for res, _ in load.ready if res.state == "FAILURE"]
        assert failed == [], failed[:5]
        starts, ends = events.starts("load"), events.ends("load")
        never = load.never_ran({e["id"] for e in starts})
        assert never == [], never
        # owed releases go out once their node takes writes: every primary
        # says so (the promoted one knows it first, the others a moment later)
        # slack: the owed release is resent every 250 ms at most once the slot
        # answers (0.3 s measured idle, docs/deployments.md); a release dropped
        # waits out the 30 s lease (the bug this guards: skips up to 25.5 s
        # late). 1 s was exceeded once on a loaded 2-core run (one skip 1.16 s
        # after every primary was ok): 3 s, the history printed on failure
        late = load.late_skips({e["id"]: e["t"] for e in ends}, max(promoted, whole or 0.0),
                               slack=3.0)
        skips = sum(1 for res, _ in load.ready if is_skipped(res.result))
        print(f"\nCluster under load{' with WAIT 1' if wait else ''}: {len(load.ready)} calls, "
              f"{skips} skipped, {len(late)} skipped against a holder finished over 1 s "
              "before (after every primary took writes again)"
              + (f", up to {max(late):.1f} s" if late else ""))
        assert late == [], _history(load, starts, ends, shard, promoted, whole)
        wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")
        locks = {hold.singleton_keys(k).lock for k in keys}
        client = cluster.client()
        try:
            wait_for(lambda: not any(client.exists(lock) for lock in locks), 10,
                     what="every key free after the drain")
        finally:
            client.close()
    finally:
        for w in workers:
            discard(w)
        if victim is not None and not victim.running:
            victim.start()
            wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")


@pytest.mark.worker
def test_a_shard_with_no_replica_after_its_failover_does_as_its_setting_says(
        cluster, redis_server, events):
    """WAIT 1 on a Cluster; a shard's primary killed: the promoted replica has
    no replica until the old primary rejoins. A worker with
    singleton_wait_no_replica='proceed' runs a task of that shard at once,
    with a warning naming the setting; one left as singleton_wait_policy says
    (release) gives each grant back, says why in its log, retries, and runs
    the task once the old primary is back as a replica."""
    base = {"singleton_wait_replicas": 1, "singleton_wait_timeout": 200}
    runs_conf = {**base, "singleton_wait_no_replica": "proceed"}
    queues = [f"nr-{uuid.uuid4().hex[:6]}-{n}" for n in ("p", "r")]
    proceed = Worker(redis_server.url(), queues[0], concurrency=1, lock_url=cluster.url(),
                     conf=runs_conf, name="p").start()
    release = Worker(redis_server.url(), queues[1], concurrency=1, lock_url=cluster.url(),
                     conf=base, name="r").start()
    victim = primary_of(cluster, 0)
    assert victim is not None
    try:
        runs_app = make_app(redis_server.url(), queues[0], lock_url=cluster.url(),
                            conf=runs_conf)
        waits_app = make_app(redis_server.url(), queues[1], lock_url=cluster.url(), conf=base)
        name = ""
        while not name:
            candidate = uuid.uuid4().hex[:8]
            lock = runs_app.tasks["t.hold"].singleton_keys(candidate).lock
            if primary_of(cluster, slot_of(lock)) == victim:
                name = candidate
        victim.stop()  # kill -9
        wait_for(lambda: (n := primary_of(cluster, 0)) is not None and n.port != victim.port,
                 30, interval=0.05, what="the replica promoted")
        ran = runs_app.tasks["t.hold"].delay(name, 0.0, "proceeds").get(timeout=30)
        assert not is_skipped(ran) and ran["tag"] == "proceeds"
        assert "(singleton_wait_no_replica: proceed)" in proceed.logs()
        waiting = waits_app.tasks["t.hold"].delay(f"{name}", 0.0, "waits")
        wait_for(lambda: "No replica acknowledged the grant" in release.logs()
                 and "(TooFewReplicasError: " in release.logs(), 30,
                 what="a grant given back, saying why")
        assert not events.starts("waits")
        victim.start()  # rejoins as the promoted node's replica
        wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")
        assert waiting.get(timeout=60)["tag"] == "waits"
    finally:
        discard(proceed)
        discard(release)
        if not victim.running:
            victim.start()
            wait_for(cluster.ok, 30, interval=0.2, what="the cluster whole again")
