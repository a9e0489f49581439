"""The native path (plain commands, no script) against a real valkey-server
9.1, which has ``DELIFEQ`` and ``SET ... IFEQ``: the promises the scripts
keep, kept without them, and the two paths on one key agreeing.

Each promise is checked on both paths where the scripts have it too (the
``path`` parameter: ``singleton_native`` ``"auto"`` or ``"off"``), so the
native path is held to what the scripts do, not to itself.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from typing import Any, Iterator

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine import paths
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import Acquire, Reclaim, Release, Renew
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.engine.conftest import PATHS
from tests.support import RedisServer, owner_field, owner_record, wait_for


@pytest.fixture
def vr(valkey: RedisServer) -> redis.Redis:
    client = valkey.client(2)
    client.flushdb()
    return client


def engine_on(url: str, path: str = "native", **settings: Any) -> LockEngine:
    engine = connect(SingletonConfig.defaults(url, native=PATHS[path], finished_ttl=60,
                                              **settings))
    assert isinstance(engine, LockEngine)
    return engine


@pytest.fixture(params=list(PATHS))
def engine(request: Any, valkey: RedisServer, vr: redis.Redis) -> Iterator[LockEngine]:
    e = engine_on(valkey.url(2), request.param)
    assert (e.path.native is not None) == (request.param == "native")
    yield e
    e.close()


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: Any, keys: LockKeys, task_id: str, exec_id: str = "", lease_ms: int = 5000,
         retries: int = 0, **kw: Any) -> Any:
    return engine.acquire(keys, Request(task_id, exec_id or uuid.uuid4().hex,
                                        Lease.of_ms(lease_ms), "w1@host", retries, "t.x", **kw))


def scripts_run(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_the_path_is_chosen_from_the_command_table(valkey, redis_server):
    """Valkey 9.1 names DELIFEQ in its command table: native; the Redis 7.0 of
    the rest of the suite has no compare-and-delete: scripts; ``off``: scripts."""
    paths.forget()
    assert engine_on(valkey.url(2)).path.native is not None
    assert engine_on(valkey.url(2)).path.scripts
    assert engine_on(valkey.url(2), "scripts").path.native is None
    assert engine_on(redis_server.url(2)).path == paths.SCRIPTS_ONLY


def test_a_default_task_locks_with_no_script(valkey, vr):
    """200 tasks with the default settings, grant to release, with renewals
    and a skipped duplicate each: not one script call, and a compare-and-delete
    per release."""
    engine = engine_on(valkey.url(2))
    assert engine.path.native is not None  # asked before counting (one script call)
    client = valkey.client()
    before = scripts_run(client)
    deletes = int(client.info("commandstats").get("cmdstat_delifeq", {}).get("calls", 0))
    for i in range(200):
        keys = new_keys()
        got = take(engine, keys, f"t{i}", f"e{i}", done=False)
        assert got.status is Acquire.GRANTED
        assert take(engine, keys, f"other{i}", done=False).status is Acquire.HELD
        assert engine.renew([(keys.lock, f"e{i}", 5000)]) == [Renew.RENEWED]
        assert engine.release(keys, f"e{i}", f"t{i}") is True
    assert scripts_run(client) == before
    after = int(client.info("commandstats")["cmdstat_delifeq"]["calls"])
    assert after - deletes >= 200


def test_release_and_renewal_are_owner_checked(engine, vr):
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a")
    assert got.status is Acquire.GRANTED and got.token > 0
    record = owner_record(vr, keys.lock)
    assert (record["task"], record["exec"], int(record["token"])) == ("task-a", "exec-a",
                                                                       got.token)
    assert engine.release(keys, "exec-other", "task-a") is False
    assert engine.renew([(keys.lock, "exec-other", 9000)]) == [Renew.NOT_OURS]
    assert vr.pttl(keys.lock) <= 5000 and vr.exists(keys.lock)
    assert engine.renew([(keys.lock, "exec-a", 9000)]) == [Renew.RENEWED]
    assert 8000 < vr.pttl(keys.lock) <= 9000
    held = take(engine, keys, "task-b")
    assert held.status is Acquire.HELD and held.holder.exec_id == "exec-a"
    assert engine.release(keys, "exec-a", "task-a") is True
    assert not vr.exists(keys.lock)
    assert engine.renew([(keys.lock, "exec-a", 9000)]) == [Renew.ABSENT]
    assert engine.release(keys, "exec-a", "task-a") is False


def test_a_renewal_of_a_lock_no_longer_held_leaves_the_fencing_counter_alone(engine, vr):
    """An execution whose lease ran out renews late (ABSENT), and again once
    another holds the key (NOT_OURS): the key's fencing counter keeps the TTL
    the last grant gave it, as renew.lua keeps it (the native path's renewal
    extended it in the same write as its compare, whatever the compare found)."""
    keys = new_keys()
    assert take(engine, keys, "task-a", "exec-a", lease_ms=20_000).status is Acquire.GRANTED
    assert engine.renew([(keys.lock, "exec-a", 25)]) == [Renew.RENEWED]
    wait_for(lambda: not vr.exists(keys.lock), 10, interval=0.01, what="the lease to run out")
    kept = vr.pttl(keys.fence)
    assert engine.renew([(keys.lock, "exec-a", 60_000)]) == [Renew.ABSENT]
    assert vr.pttl(keys.fence) <= kept
    assert take(engine, keys, "task-b", "exec-b", lease_ms=5000).status is Acquire.GRANTED
    granted = vr.pttl(keys.fence)
    assert engine.renew([(keys.lock, "exec-a", 60_000)]) == [Renew.NOT_OURS]
    assert vr.pttl(keys.fence) <= granted < 60_000 + 300_000
    assert engine.release(keys, "exec-b", "task-b") is True


def test_a_redelivered_copy_is_found_and_dropped_once_the_holder_finished(engine, vr):
    """The copy (same task id, another execution) is told SAME_TASK and marks
    the record; the holder's release, renewed past the mark, leaves the finish
    marker; the copy asking again is FINISHED; another task id is granted."""
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    copy = take(engine, keys, "task-a", "exec-copy")
    assert copy.status is Acquire.SAME_TASK and copy.holder.exec_id == "exec-a"
    assert owner_field(vr, keys.lock, "copies") == "1"
    assert engine.renew([(keys.lock, "exec-a", 5000)]) == [Renew.RENEWED]
    assert engine.release(keys, "exec-a", "task-a") is True
    assert vr.get(keys.fin) == "task-a"
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.FINISHED
    assert not vr.exists(keys.lock), "a finished task's copy holds nothing"
    assert take(engine, keys, "task-b").status is Acquire.GRANTED


def test_the_same_execution_asking_again_keeps_its_token(engine, vr):
    keys = new_keys()
    first = take(engine, keys, "task-a", "exec-a", lease_ms=3000)
    again = take(engine, keys, "task-a", "exec-a", lease_ms=9000)
    assert (again.status, again.token) == (Acquire.GRANTED, first.token)
    assert 8000 < vr.pttl(keys.lock) <= 9000
    assert engine.release(keys, "exec-a", "task-a") is True


def test_a_retry_takes_back_the_key_its_attempt_handed_off(engine, vr):
    keys = new_keys()
    first = take(engine, keys, "task-a", "exec-a")
    assert engine.hand_off(keys, "exec-a", 1, 3000) is True
    assert owner_field(vr, keys.lock, "handoff") == "1"
    assert engine.renew([(keys.lock, "exec-a", 5000)]) == [Renew.HANDED_OFF]
    assert take(engine, keys, "task-b").status is Acquire.HELD
    retried = take(engine, keys, "task-a", "exec-a2", retries=1)
    assert retried.status is Acquire.GRANTED and retried.token > first.token
    assert owner_field(vr, keys.lock, "exec") == "exec-a2"
    assert int(vr.get(keys.fence)) >= retried.token
    assert engine.release(keys, "exec-a2", "task-a") is True


def test_a_done_window_is_kept(engine, vr):
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a", done=True)
    assert engine.release(keys, "exec-a", "task-a", done_ms=30000, task_name="t.x") is True
    assert vr.get(keys.done) == "t.x\ntask-a"
    done = take(engine, keys, "task-b", done=True)
    assert (done.status, done.holder.task_id) == (Acquire.DONE, "task-a")
    assert take(engine, keys, "task-a", done=True).status is Acquire.FINISHED
    assert not vr.exists(keys.lock)


def test_tokens_go_up_past_a_counter_ahead_of_the_clock(engine, vr):
    """A counter an hour ahead of the clock (a clock stepped back): the next
    grant is the counter + 1, and so on, on either path."""
    keys = new_keys()
    ahead = int(vr.time()[0]) * 1_000_000 + 3_600_000_000
    vr.set(keys.fence, str(ahead), px=60_000)
    tokens = []
    for i in range(3):
        tokens.append(take(engine, keys, f"t{i}", f"e{i}").token)
        engine.release(keys, f"e{i}", f"t{i}")
    assert tokens == [ahead + 1, ahead + 2, ahead + 3]
    assert int(vr.get(keys.fence)) == ahead + 3


def test_the_two_paths_on_one_key_agree(valkey, vr):
    """Grants on one key alternate between a native engine and a scripted
    one, each releasing the other's lock half of the time: tokens only go up,
    every release frees, the record each writes is the other's to read."""
    native, scripted = engine_on(valkey.url(2)), engine_on(valkey.url(2), "scripts")
    keys = new_keys()
    tokens = []
    for i in range(40):
        grantor = native if i % 2 else scripted
        releaser = (scripted if grantor is native else native) if i % 4 < 2 else grantor
        got = take(grantor, keys, f"t{i}", f"e{i}", done=False)
        assert got.status is Acquire.GRANTED
        assert int(owner_record(vr, keys.lock)["token"]) == got.token
        assert take(releaser, keys, f"x{i}", done=False).status is Acquire.HELD
        tokens.append(got.token)
        assert releaser.release(keys, f"e{i}", f"t{i}") is True
        assert int(vr.get(keys.fence)) >= got.token
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_a_lock_the_server_forgot_is_written_back_one_released_is_not(valkey):
    """kill -9 and an empty start: the held lock is written back above its
    token (its counter was forgotten with it); a lock released meanwhile (its
    counter still there) is not."""
    server = RedisServer(binary=valkey.binary).start()
    try:
        engine = engine_on(server.url(0))
        keys, other = new_keys(), new_keys()
        held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000)
        server.stop()
        server.start()

        def written_back() -> Any:
            try:
                return engine.reclaim(keys, Request(task_id="task-a", exec_id="exec-a",
                                                    lease=Lease.of_ms(30_000), hostname="w1@host",
                                                    retries=0,
                                                    task_name="t.x"), held.token)
            except redis.RedisError:
                return None

        back = wait_for(written_back, 10, what="the write-back")
        assert back.status is Reclaim.WRITTEN_BACK and back.token > held.token
        assert engine.renew([(keys.lock, "exec-a", 30_000)]) == [Renew.RENEWED]
        assert take(engine, keys, "task-b").status is Acquire.HELD
        assert engine.release(keys, "exec-a", "task-a") is True
        taken = take(engine, other, "task-c", "exec-c")
        assert engine.release(other, "exec-c", "task-c") is True
        gone = engine.reclaim(other, Request(task_id="task-c", exec_id="exec-c",
                                             lease=Lease.of_ms(30_000), hostname="w1@host",
                                             retries=0,
                                             task_name="t.x"), taken.token)
        assert gone.status is Reclaim.RELEASED and not server.client().exists(other.lock)
    finally:
        server.cleanup()


def test_a_dead_holders_lock_is_freed_by_another_process(valkey, vr):
    """The worker's main process frees a killed child's lock, which another
    engine (another process) granted: read first, compared, deleted."""
    engine, reaper = engine_on(valkey.url(2)), engine_on(valkey.url(2))
    keys = new_keys()
    got = take(engine, keys, "task-a", "exec-a")
    assert reaper.release(keys, "exec-a", "task-a", finished=False) is True
    assert not vr.exists(keys.lock) and int(vr.get(keys.fence)) >= got.token


# -- contention ---------------------------------------------------------------------

def _contend(url: str, path: str, key: str, rounds: int, out: Any) -> None:
    """One process's grants of one key: inside each, a counter tells whether
    another holder is inside too, and a sequence number orders the holds."""
    engine = engine_on(url, path)
    keys = LockKeys("singleton:", key)
    client = redis.Redis.from_url(url, decode_responses=True)
    pid = os.getpid()
    done = 0
    while done < rounds:
        exec_id = uuid.uuid4().hex
        got = take(engine, keys, f"t-{pid}-{done}", exec_id, lease_ms=10_000, done=False)
        if got.status is not Acquire.GRANTED:
            continue
        inside = client.incr(f"{key}:inside")
        seq = client.incr(f"{key}:seq")
        client.decr(f"{key}:inside")
        out.put((seq, got.token, inside))
        assert engine.release(keys, exec_id, f"t-{pid}-{done}") is True
        done += 1
    engine.close()


def test_tokens_follow_the_order_of_the_holds_under_contention(valkey, vr):
    """Four processes, two native and two scripted, take one key 150 times
    each as fast as they can: never two holders at once, and in the order the
    holds happened every token is above the one before (the proposals of
    different processes interleave with the scripts' clock)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    key = uuid.uuid4().hex
    url = valkey.url(2)
    procs = [ctx.Process(target=_contend, args=(url, path, key, 150, out))
             for path in ("native", "scripts", "native", "scripts")]
    for p in procs:
        p.start()
    holds = [out.get(timeout=120) for _ in range(600)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    holds.sort()
    assert [h[0] for h in holds] == list(range(1, 601))
    assert all(inside == 1 for _, _, inside in holds)
    tokens = [token for _, token, _ in holds]
    assert all(a < b for a, b in zip(tokens, tokens[1:]))


def test_a_counter_lost_with_a_restart_leaves_tokens_going_up(valkey):
    """An empty restart forgets the counter; the server clock, which moved on
    for longer than a token may run ahead of it (2 ms), is their floor."""
    server = RedisServer(binary=valkey.binary).start()
    try:
        engine = engine_on(server.url(0))
        keys = new_keys()
        tokens = []
        for round_ in range(3):
            for i in range(20):
                got = take(engine, keys, f"t{round_}-{i}", f"e{round_}-{i}", done=False)
                tokens.append(got.token)
                engine.release(keys, f"e{round_}-{i}", f"t{round_}-{i}")
            server.stop()
            server.start()
            wait_for(lambda: _answers(engine), 10, what="the server back")
        assert all(a < b for a, b in zip(tokens, tokens[1:]))
    finally:
        server.cleanup()


def _answers(engine: LockEngine) -> bool:
    try:
        return engine.owner(new_keys()) == {}
    except redis.RedisError:
        time.sleep(0.05)
        return False


# -- a server that runs no script -----------------------------------------------------

@pytest.fixture(scope="module")
def no_scripts_url(valkey: RedisServer) -> str:
    """An ACL user allowed everything but scripts (``-@scripting``), as some
    managed deployments give."""
    valkey.client().execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*",
                                    "+@all", "-@scripting")
    return f"redis://noscripts:pw@127.0.0.1:{valkey.port}/2"


def test_where_the_server_runs_no_script_the_native_path_is_the_only_one(no_scripts_url, vr):
    """The path asked of a server that refuses scripts: native only. A default
    task's lock through its whole life works (grant, a copy found, renewal,
    hand-off and the retry taking it back, release, a dead holder freed by
    another process, a write-back), the options only a script serves are
    named, and the doctor says so instead of failing."""
    from celery_singleton_lock.checks.doctor import engine_checks
    from celery_singleton_lock.checks.findings import ERROR

    paths.forget()
    engine, other = engine_on(no_scripts_url), engine_on(no_scripts_url)
    assert engine.path.native is not None and not engine.path.scripts
    keys = new_keys()
    first = take(engine, keys, "task-a", "exec-a")
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK
    assert engine.renew([(keys.lock, "exec-a", 5000)]) == [Renew.RENEWED]
    assert engine.hand_off(keys, "exec-a", 1, 3000) is True
    retried = take(engine, keys, "task-a", "exec-a2", retries=1)
    assert retried.status is Acquire.GRANTED and retried.token > first.token
    assert other.release(keys, "exec-a2", "task-a", finished=False) is True
    assert engine.renew([(keys.lock, "exec-a2", 5000)]) == [Renew.ABSENT]
    assert engine.reclaim(keys, Request(task_id="task-a", exec_id="exec-a2",
                                        lease=Lease.of_ms(5000), hostname="w1@host", retries=1,
                                        task_name="t.x"), retried.token).status is Reclaim.RELEASED
    assert engine.claim("singleton:{tick}:claim", "beat-1", 5000) == (True, "beat-1")
    assert engine.unclaim("singleton:{tick}:claim", "beat-1") is True
    config = SingletonConfig.defaults(no_scripts_url, limit=3, throttle=2.0)
    assert engine.unserved(config) == ["singleton_limit", "singleton_throttle"]
    assert engine.unserved(SingletonConfig.defaults(no_scripts_url, done_ttl=5.0)) == []
    with pytest.raises(redis.ResponseError):
        take(engine, new_keys(), "task-l", slots=2)  # a script: refused by the server
    findings = engine_checks(engine)
    assert not [f for f in findings if f.level == ERROR], findings
    assert {"commands", "scripts"} <= {f.code for f in findings}


@pytest.mark.worker
def test_a_worker_on_a_server_that_runs_no_script(valkey, no_scripts_url):
    """With the test app's every task, the worker refuses to start, naming the
    first task whose options need a script and the setting; with only tasks
    that need none it starts, and a storm of duplicates runs one at a time."""
    from tests.conftest import Events
    from tests.contract import promises
    from tests.support import Worker, discard
    from tests.workerapp import make_app

    conf = {"singleton_ttl": 30.0}
    refused = Worker(valkey.url(), f"ns-{uuid.uuid4().hex[:6]}", pool="solo", conf=conf,
                     lock_url=no_scripts_url)
    refused.start(wait=False)
    assert refused.proc is not None
    try:
        assert refused.proc.wait(30) != 0
        output = refused.output()
    finally:
        refused.stop()
    assert ("configuration error: singleton_scope: task 't.collect': the lock Redis runs no "
            "script") in output, output
    conf = {"singleton_ttl": 30.0, "slt_native_only": True}
    worker = Worker(valkey.url(), f"ns-{uuid.uuid4().hex[:6]}", concurrency=3, conf=conf,
                    lock_url=no_scripts_url).start()
    try:
        assert "native commands only" in worker.logs() or "runs no script" in worker.logs()
        app = make_app(valkey.url(), worker.queue, lock_url=no_scripts_url, conf=conf)
        events = Events(valkey)
        events.client.delete("events")
        promises.duplicate_storm_runs_one_at_a_time(app, events, uuid.uuid4().hex[:12])
    finally:
        discard(worker)


def test_the_counter_lives_the_lease_and_the_retention_on_both_paths(valkey, vr):
    """The native path keeps the key's counter as the scripts do: the lease and
    ``singleton_fence_ttl`` (at least a tenth of the lease) from the grant and
    from each renewal, ``singleton_fence_ttl`` after a release that raised it."""
    for path in PATHS:
        engine = engine_on(valkey.url(2), path, fence_ttl=1.0)
        keys = new_keys()
        assert take(engine, keys, "t", "e", lease_ms=60_000).status is Acquire.GRANTED
        assert 65_000 < vr.pttl(keys.fence) <= 66_000, path
        vr.pexpire(keys.fence, 1_000)
        assert engine.renew([(keys.lock, "e", 60_000)]) == [Renew.RENEWED]
        assert 65_000 < vr.pttl(keys.fence) <= 66_000, path
        assert engine.release(keys, "e", "t") is True


def test_a_late_release_by_a_holder_whose_lease_ran_out_leaves_the_next_holders_lock(valkey, vr):
    """A holder's lease runs out and another execution takes the key; the
    first holder's release comes late: from the process that was granted the
    lock (it still remembers the record it wrote), from another process (a
    worker's main process freeing its child's lock), and sent without waiting.
    None of them frees anything: the other execution's lock stays, its record
    and its lease untouched. Each path and each engine on its own key."""
    for path in PATHS:
        engine, reaper = engine_on(valkey.url(2), path), engine_on(valkey.url(2), path)
        for how in ("granted here", "another process", "without waiting"):
            keys = new_keys()
            assert take(engine, keys, "task-a", "exec-a", lease_ms=50).status is Acquire.GRANTED
            wait_for(lambda k=keys: not vr.exists(k.lock), 10, what="the first lease to run out")
            second = take(reaper, keys, "task-b", "exec-b", lease_ms=60_000)
            assert second.status is Acquire.GRANTED, (path, how)
            record = vr.get(keys.lock)
            if how == "granted here":
                assert engine.release(keys, "exec-a", "task-a") is False, (path, how)
            elif how == "another process":
                assert reaper.release(keys, "exec-a", "task-a", finished=False) is False
            else:
                answers: list[Any] = []
                engine.release_later(keys, "exec-a", "task-a",
                                     lambda reply, error, out=answers: out.append((reply, error)))
                engine.settle()
                assert answers and answers[0][1] is None, (path, answers)
                assert answers[0][0].status is Release.TAKEN, (path, answers)
            assert vr.get(keys.lock) == record, (path, how)
            assert owner_field(vr, keys.lock, "exec") == "exec-b"
            assert 50_000 < vr.pttl(keys.lock) <= 60_000, (path, how)
            assert reaper.renew([(keys.lock, "exec-b", 60_000)]) == [Renew.RENEWED]
            assert reaper.release(keys, "exec-b", "task-b") is True
        engine.close()
        reaper.close()


def test_a_write_back_finds_the_lock_still_its_own_or_another_holders(engine, vr):
    """A write-back (the renewer, on ABSENT) that finds the key after all: its
    own lock keeps its token and gets its lease anew; once its lease ran out
    and another execution took the key, HELD, naming that holder, whose lock
    is left as it is."""
    keys = new_keys()
    held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000)
    vr.pexpire(keys.lock, 5000)
    request = Request("task-a", "exec-a", Lease.of_ms(30_000), "w1@host", task_name="t.x")
    mine = engine.reclaim(keys, request, held.token)
    assert (mine.status, mine.token) == (Reclaim.OURS, held.token)
    assert 20_000 < vr.pttl(keys.lock) <= 30_000
    # its lease runs out, another execution takes the key: the first's
    # write-back finds it HELD and leaves it
    assert engine.renew([(keys.lock, "exec-a", 25)]) == [Renew.RENEWED]
    wait_for(lambda: not vr.exists(keys.lock), 10, interval=0.01, what="the lease to run out")
    later = take(engine, keys, "task-b", "exec-b", lease_ms=30_000)
    theirs = engine.reclaim(keys, request, held.token)
    assert theirs.status is Reclaim.HELD
    assert (theirs.holder.task_id, theirs.holder.exec_id) == ("task-b", "exec-b")
    assert owner_field(vr, keys.lock, "exec") == "exec-b"
    assert int(owner_field(vr, keys.lock, "token")) == later.token
    assert engine.release(keys, "exec-b", "task-b") is True


def test_a_lock_granted_ahead_of_the_clock_is_written_back_above_its_token_on_both_paths(
        engine, vr):
    """A counter ahead of the clock gives a token ahead of it; the lock and
    its counter forgotten, the write-back comes above that token (the clock
    alone is below it), and the counter with it."""
    keys = new_keys()
    ahead = int(vr.time()[0]) * 1_000_000 + 3_600_000_000
    vr.set(keys.fence, str(ahead), px=60_000)
    held = take(engine, keys, "task-a", "exec-a", lease_ms=30_000).token
    assert held == ahead + 1
    engine.settle()
    vr.delete(keys.lock, keys.fence, keys.back)
    request = Request("task-a", "exec-a", Lease.of_ms(30_000), "w1@host", task_name="t.x")
    back = engine.reclaim(keys, request, held)
    assert (back.status, back.token) == (Reclaim.WRITTEN_BACK, held + 1)
    assert int(owner_field(vr, keys.lock, "token")) == held + 1
    assert owner_field(vr, keys.lock, "exec") == "exec-a"
    assert int(vr.get(keys.fence)) == held + 1
    assert engine.release(keys, "exec-a", "task-a") is True


def test_only_the_retry_an_attempt_handed_off_to_takes_the_key_back(engine, vr):
    """A hand-off keeps the key for retry 1: a redelivered copy of the attempt
    (retry 0) and a later retry (2) are copies of a running task, not granted."""
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    assert engine.hand_off(keys, "exec-a", 1, 5000) is True
    for retries in (0, 2):
        copy = take(engine, keys, "task-a", f"exec-r{retries}", retries=retries)
        assert copy.status is Acquire.SAME_TASK, retries
        assert owner_field(vr, keys.lock, "exec") == "exec-a"
    retried = take(engine, keys, "task-a", "exec-r1", retries=1)
    assert retried.status is Acquire.GRANTED
    assert owner_field(vr, keys.lock, "exec") == "exec-r1"
    assert engine.release(keys, "exec-r1", "task-a") is True


def test_a_finished_task_is_named_as_its_own_holder(engine, vr):
    """FINISHED, from the finish marker or from the done window, names the
    task that finished (the skip's log line and result name it)."""
    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK
    assert engine.release(keys, "exec-a", "task-a") is True
    fin = take(engine, keys, "task-a", "exec-copy")
    assert (fin.status, fin.holder.task_id) == (Acquire.FINISHED, "task-a")
    done_keys = new_keys()
    take(engine, done_keys, "task-d", "exec-d", done=True)
    assert engine.release(done_keys, "exec-d", "task-d", done_ms=30_000, task_name="t.x")
    again = take(engine, done_keys, "task-d", "exec-d2", done=True)
    assert (again.status, again.holder.task_id) == (Acquire.FINISHED, "task-d")
    assert not vr.exists(keys.lock) and not vr.exists(done_keys.lock)


def test_a_grant_raises_a_counter_it_finds_below_its_token(engine, vr):
    """A counter left low (a key granted long ago, within the retention): the
    grant's token is the clock, and the counter is raised to it (on the native
    path right behind the grant, without waiting), with the lease and the
    retention as its TTL; the next grant comes above it."""
    from celery_singleton_lock.engine.calls import fence_ttl_ms

    keys = new_keys()
    vr.set(keys.fence, "5", px=10_000)
    got = take(engine, keys, "task-a", "exec-a", lease_ms=30_000)
    assert got.status is Acquire.GRANTED and got.token > 5
    engine.settle()
    wait_for(lambda: int(vr.get(keys.fence)) == got.token, 10,
             what="the counter to be raised to the grant's token")
    counter = fence_ttl_ms(30_000, 300_000)
    assert counter - 10_000 < vr.pttl(keys.fence) <= counter
    if engine.path.native:
        # the holder asking again (its reply lost on the way) finds the
        # counter below its token (its grant's raise, sent without waiting,
        # not there yet): it raises it too. (A script's grant writes both in
        # one step: no script finds them apart.)
        vr.set(keys.fence, "5", px=10_000)
        again = take(engine, keys, "task-a", "exec-a", lease_ms=30_000)
        assert (again.status, again.token) == (Acquire.GRANTED, got.token)
        engine.settle()
        wait_for(lambda: int(vr.get(keys.fence)) == got.token, 10,
                 what="the counter to be raised to the holder's token")
    assert engine.release(keys, "exec-a", "task-a") is True
    assert take(engine, keys, "task-b", "exec-b").token > got.token


def test_a_release_sent_without_waiting_answers_what_it_found(engine, no_scripts_url, valkey,
                                                               vr):
    """``release_later``, as a task's end sends it: the holder's own grant is
    freed (RELEASED); a lock granted in another process, by its execution id,
    too (on the native path by a process whose server runs no script); a
    late one after the lease ran out and another took the key is TAKEN
    and leaves that lock; a released key asked again is FREE. A copy seen
    leaves the finish marker."""
    answers: list[Any] = []

    def answered(reply: Any, error: Any) -> None:
        answers.append(error if error is not None else reply.status)

    def release_later(e: Any, keys: LockKeys, exec_id: str, task_id: str) -> Any:
        e.release_later(keys, exec_id, task_id, answered)
        e.settle()
        wait_for(lambda: answers, 10, what="the release's reply")
        return answers.pop()

    keys = new_keys()
    take(engine, keys, "task-a", "exec-a")
    assert take(engine, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK
    assert engine.renew([(keys.lock, "exec-a", 5000)]) == [Renew.RENEWED]
    assert release_later(engine, keys, "exec-a", "task-a") is Release.RELEASED
    assert not vr.exists(keys.lock) and vr.get(keys.fin) == "task-a"
    assert release_later(engine, keys, "exec-a", "task-a") is Release.FREE

    # another process: on the native path, one whose server runs no script
    # (every release there is the native path's, granted here or not)
    paths.forget()
    other = (engine_on(no_scripts_url) if engine.path.native
             else engine_on(valkey.url(2), "scripts"))
    try:
        keys = new_keys()
        take(engine, keys, "task-b", "exec-b")
        assert release_later(other, keys, "exec-b", "task-b") is Release.RELEASED
        assert not vr.exists(keys.lock)
        take(engine, keys, "task-c", "exec-c")
        assert engine.renew([(keys.lock, "exec-c", 25)]) == [Renew.RENEWED]
        wait_for(lambda: not vr.exists(keys.lock), 10, interval=0.01,
                 what="the lease to run out")
        take(other, keys, "task-d", "exec-d")
        assert release_later(engine, keys, "exec-c", "task-c") is Release.TAKEN
        assert owner_field(vr, keys.lock, "exec") == "exec-d"
        assert other.release(keys, "exec-d", "task-d") is True
    finally:
        other.close()
