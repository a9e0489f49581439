"""The native path's compare-and-write loops, raced: another writer changes
the key between the engine's read and its conditional write, against a real
valkey-server.

Each read-then-write of :mod:`celery_singleton_lock.engine.native` (a copy's
mark, the rewrite of a record, the raise of a fencing counter, a release that
reads first, a renewal that reads again, a grant that starts over, a holder's
lease given anew after a grant or a write-back found the lock its own) is driven
through that interleaving: :func:`interleave` wraps the :class:`Native`
object's ``send`` so that, right after the engine's nth round trip (0: before
its first, right after the grant's own read), the test writes the key as
another execution would, through another engine or a plain client. No sleep
is raced against anything: the interleaving is the hook's.

Each test checks what the engine answers and what the server holds after
(the owner record, the fencing counter, their TTLs): a write that is not
compared, a retry skipped or made with the record it read before, or the
wrong answer once the key is another's, fails one of them.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Iterator, Optional, Sequence, cast

import pytest
import redis

from celery_singleton_lock import SingletonConfig
from celery_singleton_lock.engine.calls import fence_ttl_ms
from celery_singleton_lock.engine.commands import Command, fields_of, with_token
from celery_singleton_lock.engine.native import Native
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.replies import (
    Acquire,
    Acquired,
    Reclaim,
    Release,
    Released,
    Renew,
)
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.testing import RedisServer

#: what a callback does to the server between two of the engine's round trips
Step = Callable[[], None]
#: makes a native engine (on the valkey's URL, or the one given)
Engines = Callable[..., LockEngine]


@pytest.fixture
def vr(valkey: RedisServer) -> redis.Redis:
    """The other writer: a plain client on the engines' database."""
    client: redis.Redis = valkey.client(2)
    client.flushdb()
    return client


@pytest.fixture(scope="module")
def no_scripts_url(valkey: RedisServer) -> str:
    """A user allowed everything but scripts: its engine's every call is the
    native path's, a lock granted in another process included (a worker's
    main process freeing its child's lock, a hand-off of a lock it did not
    grant)."""
    cast(Any, valkey.client()).execute_command("ACL", "SETUSER", "racer", "on", ">pw", "~*", "&*",
                                    "+@all", "-@scripting")
    return f"redis://racer:pw@127.0.0.1:{valkey.port}/2"


@pytest.fixture
def engines(valkey: RedisServer, no_scripts_url: str, vr: redis.Redis
            ) -> Iterator[Engines]:
    """Native engines on the valkey, each its own process's as far as the
    lock goes (its own connection and its own held records); closed after."""
    made: list[LockEngine] = []

    def make(url: str = valkey.url(2)) -> LockEngine:
        engine = connect(SingletonConfig.defaults(url, native="auto", finished_ttl=60))
        assert isinstance(engine, LockEngine)
        assert engine.path.native is not None and engine.native is not None
        # the server clock read now (a connection reads it): a grant's first
        # round trip is the grant, not a TIME, and the hooks count the lock's
        engine.clock_offset(ask=True)
        assert engine.native.clock.known
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def reaper(engines: Engines, no_scripts_url: str) -> LockEngine:
    """A native engine that holds nothing and runs no script: it releases and
    hands off locks other processes were granted, reading them first."""
    engine = engines(no_scripts_url)
    assert engine.native is not None and engine.native.everything
    return engine


def native_of(engine: LockEngine) -> Native:
    assert engine.native is not None
    return engine.native


def interleave(engine: LockEngine, steps: dict[int, Step]) -> list[Sequence[Command]]:
    """Run ``steps[n]`` right after the engine's nth ``send`` returned (0:
    right before its first, so after a grant's own read, which is no
    ``send``); return what it sent, one list of commands a round trip, to
    show where each step fell."""
    native = native_of(engine)
    send = native.send
    sent: list[Sequence[Command]] = []

    def raced(commands: Sequence[Command]) -> tuple[list[Any], bool]:
        if not sent and 0 in steps:
            steps[0]()
        sent.append(list(commands))
        out = send(commands)
        step = steps.get(len(sent))
        if step is not None:
            step()
        return out

    native.send = raced  # type: ignore[method-assign]
    return sent


def before_raise_behind_grant(engine: LockEngine, keys: LockKeys, step: Step) -> list[Command]:
    """Run ``step`` right before the engine sends the raise of ``keys``'s
    counter that follows a grant without waiting (its read was the grant's);
    return that raise's commands."""
    wire = native_of(engine).wire
    call_later = wire.call_later
    raises: list[Command] = []

    def raced(script: Any, names: Sequence[str], args: Sequence[Any], answered: Any,
              owe: bool = False) -> None:
        if args and args[0][:2] == ("SET", keys.fence) and not raises:
            raises.extend(args)
            step()
        call_later(script, names, args, answered, owe)

    wire.call_later = raced  # type: ignore[method-assign,assignment]
    return raises


def new_keys() -> LockKeys:
    return LockKeys("singleton:", uuid.uuid4().hex)


def take(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str,
         lease_ms: int = 5000, retries: int = 0) -> Acquired:
    return engine.acquire(keys, Request(task_id, exec_id, Lease.of_ms(lease_ms), "w1@host",
                                        retries, "t.x"))


def granted(engine: LockEngine, keys: LockKeys, task_id: str, exec_id: str,
            lease_ms: int = 5000) -> int:
    got = take(engine, keys, task_id, exec_id, lease_ms)
    assert got.status is Acquire.GRANTED, got
    engine.settle()  # a raise of the counter sent behind the grant, answered
    return got.token


def release_status(engine: LockEngine, keys: LockKeys, exec_id: str, task_id: str) -> Release:
    """What a release found (``release`` says only whether it freed the key)."""
    answers: list[tuple[Optional[Released], Optional[Exception]]] = []
    engine.release_later(keys, exec_id, task_id, lambda r, e: answers.append((r, e)))
    engine.settle()
    assert len(answers) == 1 and answers[0][1] is None and answers[0][0] is not None, answers
    return answers[0][0].status


def field(record: Optional[str], name: str) -> str:
    assert record is not None
    return fields_of(record)[{"exec": 0, "handoff": 1, "copies": 2, "token": 3}[name]]


def change(vr: redis.Redis, lock: str, how: Callable[[str], str]) -> str:
    """Rewrite the record as another writer would, keeping its TTL."""
    record = vr.get(lock)
    assert isinstance(record, str)
    new = how(record)
    assert vr.set(lock, new, keepttl=True)
    return new


def handed(record: str, retries: int = 1) -> str:
    """The record as a hand-off to retry ``retries`` writes it."""
    f = record.split("\n", 2)
    return "\n".join((f[0], str(retries), f[2]))


def record_of(vr: redis.Redis, keys: LockKeys) -> Optional[str]:
    """The owner record the server holds (None: the key is free)."""
    value = vr.get(keys.lock)
    assert value is None or isinstance(value, str)
    return value


def taken_by(other: LockEngine, vr: redis.Redis, keys: LockKeys, lease_ms: int
             ) -> tuple[Step, list[Optional[str]]]:
    """A step in which the key changes hands: freed, then granted to ``other``
    (task-b, exec-b) for ``lease_ms``; the record it wrote lands in the list."""
    theirs: list[Optional[str]] = []

    def taken() -> None:
        vr.delete(keys.lock)
        granted(other, keys, "task-b", "exec-b", lease_ms=lease_ms)
        theirs.append(record_of(vr, keys))

    return taken, theirs


def counter(vr: redis.Redis, keys: LockKeys) -> Optional[int]:
    value = vr.get(keys.fence)
    return None if value is None else int(value)


# -- a copy's mark (_mark_copied) ------------------------------------------------------

def test_a_copy_marks_the_record_as_its_holder_changed_it_after_the_grant_read(engines: Engines,
        vr: redis.Redis) -> None:
    """A redelivered copy reads the holder's record in its grant; before its
    mark lands, the holder hands the key off (a new record, a new TTL). The
    mark, compared with what it read, misses, and is made again on the record
    as it is now: it keeps the hand-off and its TTL and adds the mark, so the
    retry's release will leave the finish marker the copy needs."""
    holder, copy = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")
    sent = interleave(copy, {0: lambda: assert_true(holder.hand_off(keys, "exec-a", 1, 7000))})
    got = take(copy, keys, "task-a", "exec-copy")
    assert got.status is Acquire.SAME_TASK and got.holder is not None
    assert got.holder.exec_id == "exec-a"
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "handoff"), field(record, "copies")) == (
        "exec-a", "1", "1")
    assert 6000 < vr.pttl(keys.lock) <= 7000, "the mark keeps the hand-off's TTL"
    assert [c[0][0] for c in sent] == ["SET", "SET"], "missed once, then made on the new record"


@pytest.mark.parametrize("meanwhile", ["released", "taken by another execution"])
def test_a_copy_does_not_mark_a_key_its_holder_left_after_the_grant_read(engines: Engines,
        vr: redis.Redis, meanwhile: Optional[str]) -> None:
    """Between the copy's grant (which read the holder's record) and its mark,
    the holder releases the key, and another execution may take it: the copy
    is still told SAME_TASK (of the holder it read), and writes nothing: no
    record brought back, no mark on the other execution's record."""
    holder, copy, other = engines(), engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")
    theirs: list[Optional[str]] = [None]

    def leave() -> None:
        assert holder.release(keys, "exec-a", "task-a") is True
        if meanwhile != "released":
            granted(other, keys, "task-b", "exec-b", lease_ms=9000)
            theirs[0] = record_of(vr, keys)

    interleave(copy, {0: leave})
    got = take(copy, keys, "task-a", "exec-copy")
    assert got.status is Acquire.SAME_TASK and got.holder is not None
    assert got.holder.exec_id == "exec-a"
    assert record_of(vr, keys) == theirs[0]
    if theirs[0] is not None:
        assert 8000 < vr.pttl(keys.lock) <= 9000
        assert other.release(keys, "exec-b", "task-b") is True
        assert vr.get(keys.fin) is None, "no copy of task-b was seen"


# -- a grant's second write (_rewrite, acquire's ``again``) ----------------------------

def counter_ahead(vr: redis.Redis, keys: LockKeys) -> int:
    """A counter an hour ahead of the clock: a grant's proposed token does not
    stand, and the grant writes its record again with the counter + 1."""
    seconds, _ = vr.time()
    ahead = int(seconds) * 1_000_000 + 3_600_000_000
    vr.set(keys.fence, str(ahead), px=60_000)
    return ahead


def test_a_grant_rewrites_its_token_into_the_record_a_copy_marked_meanwhile(engines: Engines,
        vr: redis.Redis) -> None:
    """The grant's proposed token does not stand (the counter is ahead); before
    its second write (the token), a copy marks the record. The rewrite misses,
    reads the record again (still this execution's) and writes the token into
    it as it is now: the grant's token is the counter + 1, the record holds it
    and keeps the copy's mark, the counter is raised to it, and the release
    leaves the finish marker for the copy."""
    grantor, copier = engines(), engines()
    keys = new_keys()
    ahead = counter_ahead(vr, keys)

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    sent = interleave(grantor, {0: copy_marks})
    got = take(grantor, keys, "task-a", "exec-a")
    assert (got.status, got.token) == (Acquire.GRANTED, ahead + 1)
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "token"), field(record, "copies")) == (
        "exec-a", str(ahead + 1), "1")
    assert counter(vr, keys) == ahead + 1
    assert [c[0][:2] for c in sent[:3]] == [("SET", keys.lock), ("GET", keys.lock),
                                            ("SET", keys.lock)]
    assert grantor.release(keys, "exec-a", "task-a") is True
    assert vr.get(keys.fin) == "task-a" and not vr.exists(keys.lock)


def test_a_grant_whose_key_was_taken_between_its_two_writes_decides_again(engines: Engines,
        vr: redis.Redis) -> None:
    """Before the grant's second write (its token), the key changes hands (its
    lease ran out, another execution took it). The rewrite finds the record
    not its own and writes nothing; the grant starts over and is told HELD by
    the other execution, whose record, lease and counter stay as it left them."""
    grantor, other = engines(), engines()
    keys = new_keys()
    ahead = counter_ahead(vr, keys)
    theirs: list[Any] = []

    def taken() -> None:
        vr.delete(keys.lock)
        theirs.append(granted(other, keys, "task-b", "exec-b", lease_ms=9000))
        theirs.append(record_of(vr, keys))

    interleave(grantor, {0: taken})
    got = take(grantor, keys, "task-a", "exec-a")
    assert got.status is Acquire.HELD and got.holder is not None
    assert got.holder.exec_id == "exec-b"
    assert theirs[0] == ahead + 1
    assert record_of(vr, keys) == theirs[1] and 8000 < vr.pttl(keys.lock) <= 9000
    assert counter(vr, keys) == ahead + 1
    assert not native_of(grantor).held, "nothing held by the grant that lost the key"


def test_a_retry_whose_handed_record_changed_before_it_took_it_back_starts_over(engines: Engines,
        vr: redis.Redis) -> None:
    """The retry an attempt handed the key off to reads the handed record in
    its grant; before it takes the key back, a redelivered copy of the attempt
    marks the record. The take-back, compared with what it read, misses; the
    grant starts over from the record as it is now and takes the key back:
    the record is the retry's, above the attempt's token."""
    attempt, retry, copier = engines(), engines(), engines()
    keys = new_keys()
    first = granted(attempt, keys, "task-a", "exec-a")
    assert attempt.hand_off(keys, "exec-a", 1, 7000) is True

    def copy_marks() -> None:
        copy = take(copier, keys, "task-a", "exec-copy", retries=0)
        assert copy.status is Acquire.SAME_TASK
        assert field(record_of(vr, keys), "copies") == "1"

    sent = interleave(retry, {0: copy_marks})
    got = take(retry, keys, "task-a", "exec-a2", retries=1)
    assert got.status is Acquire.GRANTED and got.token > first
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "token")) == ("exec-a2", str(got.token))
    assert len([c for c in sent if c[0][:2] == ("SET", keys.lock)]) == 2
    assert retry.release(keys, "exec-a2", "task-a") is True


def test_a_grant_whose_record_keeps_changing_gives_up_having_taken_nothing(engines: Engines,
        vr: redis.Redis) -> None:
    """A take-back whose record changes before each of its writes starts over
    a bounded number of times, then fails with an error, the record left as
    the other writer last wrote it."""
    attempt, retry = engines(), engines()
    keys = new_keys()
    granted(attempt, keys, "task-a", "exec-a")
    assert attempt.hand_off(keys, "exec-a", 1, 7000) is True
    rewrites = [0]
    native = native_of(retry)
    send = native.send

    def raced(commands: Sequence[Command]) -> tuple[list[Any], bool]:
        if commands[0][0] == "SET" and commands[0][1] == keys.lock:
            rewrites[0] += 1
            change(vr, keys.lock, lambda r: with_token(r, rewrites[0], rewrites[0]))
        return send(commands)

    native.send = raced  # type: ignore[method-assign]
    with pytest.raises(redis.ResponseError, match="kept changing"):
        take(retry, keys, "task-a", "exec-a2", retries=1)
    assert rewrites[0] == 9, "the first try and eight more"
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "token")) == ("exec-a", "9")
    assert not native.held


def assert_true(value: object) -> None:
    assert value is True


# -- a hand-off (_rewrite) -------------------------------------------------------------

def test_a_hand_off_keeps_the_copy_mark_written_between_its_read_and_write(engines: Engines,
        vr: redis.Redis) -> None:
    """The holder hands the key off to its retry; a copy marked the record
    since the holder last read it. The hand-off, compared, misses, reads the
    record again (still its own) and hands that off: the record carries both
    the hand-off and the mark, with the hand-off's lease, and the retry takes
    it back."""
    holder, copier, retry = engines(), engines(), engines()
    keys = new_keys()
    first = granted(holder, keys, "task-a", "exec-a")

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    sent = interleave(holder, {0: copy_marks})
    assert holder.hand_off(keys, "exec-a", 1, 7000) is True
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "handoff"), field(record, "copies")) == (
        "exec-a", "1", "1")
    assert 6000 < vr.pttl(keys.lock) <= 7000
    assert [c[0][0] for c in sent] == ["SET", "GET", "SET"]
    back = take(retry, keys, "task-a", "exec-a2", retries=1)
    assert back.status is Acquire.GRANTED and back.token > first


def test_a_hand_off_of_a_key_taken_meanwhile_fails_and_leaves_it(engines: Engines,
        vr: redis.Redis) -> None:
    """The holder's lease ran out and another execution took the key before
    the hand-off's write: the hand-off reports failure and leaves the other's
    record and lease as they were."""
    holder, other = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")
    taken, theirs = taken_by(other, vr, keys, lease_ms=9000)
    interleave(holder, {0: taken})
    assert holder.hand_off(keys, "exec-a", 1, 7000) is False
    assert record_of(vr, keys) == theirs[0] and 8000 < vr.pttl(keys.lock) <= 9000


# -- a raise of the fencing counter (_raise) -------------------------------------------

@pytest.mark.parametrize(("found", "meanwhile"), [
    ("5", "higher"),  # another raise, above the token: it stays
    ("5", "7"),  # another raise, still below the token: raised past it
    ("5", None),  # the counter lost: created at the token
    (None, "7"),  # none when read, created below the token since: raised
    (None, "higher"),  # none when read, created above the token since: it stays
])
def test_a_counter_raise_racing_another_write_leaves_the_maximum(engines: Engines,
        reaper: LockEngine, vr: redis.Redis, found: Optional[str],
        meanwhile: Optional[str]) -> None:
    """A hand-off by a process that did not grant the lock raises the key's
    counter to the lock's token first, from the counter it read (``found``).
    Between that read and the raise, another writer sets the counter
    (``meanwhile``: above the token, below it, or deletes it). The raise is a
    create or a compared write, tried again on what the counter holds now:
    the counter ends at the larger of the token and the other write, never
    below the token, never lowered, with the other's TTL when it stays."""
    holder = engines()
    keys = new_keys()
    token = granted(holder, keys, "task-a", "exec-a")
    if found is None:
        vr.delete(keys.fence)
    else:
        vr.set(keys.fence, found, px=60_000)
    other = token + 1000 if meanwhile == "higher" else (
        None if meanwhile is None else int(meanwhile))

    def write() -> None:
        if other is None:
            vr.delete(keys.fence)
        else:
            vr.set(keys.fence, str(other), px=60_000)

    # the hand-off reads the record, then the counter: the other write lands after
    sent = interleave(reaper, {2: write})
    assert reaper.hand_off(keys, "exec-a", 1, 7000) is True
    assert sent[1] == [("GET", keys.fence)]
    assert counter(vr, keys) == max(token, other or 0)
    ttl = vr.pttl(keys.fence)
    if other is not None and other > token:
        assert 59_000 < ttl <= 60_000, "the higher counter left as it was"
    else:
        fence_ms = fence_ttl_ms(7000, native_of(reaper).keep_ms)
        assert fence_ms - 1000 < ttl <= fence_ms
    assert field(record_of(vr, keys), "handoff") == "1"


# -- a release that reads first (_released, _release_read) -----------------------------

@pytest.mark.parametrize("waiting", [True, False], ids=["release", "release_later"])
def test_a_holders_release_finds_the_copy_mark_written_since_its_grant(engines: Engines,
        vr: redis.Redis, waiting: bool) -> None:
    """The holder's release compares the record it wrote; a copy marked it
    since. The release misses, reads the record (its own, marked) and frees
    it, leaving the finish marker the copy needs: RELEASED. The same for a
    release sent without waiting (its second look made when its reply is
    read)."""
    holder, copier = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    if waiting:
        sent = interleave(holder, {0: copy_marks})
        assert holder.release(keys, "exec-a", "task-a") is True
        assert [c[-1][0] for c in sent] == ["DELIFEQ", "GET", "DELIFEQ"]
    else:
        copy_marks()
        assert release_status(holder, keys, "exec-a", "task-a") is Release.RELEASED
    assert not vr.exists(keys.lock) and vr.get(keys.fin) == "task-a"


def test_a_release_read_first_frees_the_record_as_a_copy_marked_it_meanwhile(engines: Engines,
        reaper: LockEngine, vr: redis.Redis) -> None:
    """A process that did not grant the lock releases it (a worker's main
    process, its child dead): it reads the record, and before its delete
    lands a copy marks it. The delete, compared, misses; the release reads
    again, finds the execution's record marked, and frees it with the finish
    marker: RELEASED."""
    holder, copier = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    sent = interleave(reaper, {1: copy_marks})
    assert release_status(reaper, keys, "exec-a", "task-a") is Release.RELEASED
    assert not vr.exists(keys.lock) and vr.get(keys.fin) == "task-a"
    assert [c[0][0] for c in sent] == ["GET", "DELIFEQ", "GET", "SET"]


@pytest.mark.parametrize("meanwhile", ["taken by another execution", "released"])
def test_a_release_read_first_leaves_a_key_that_changed_hands_meanwhile(engines: Engines,
        reaper: LockEngine, vr: redis.Redis, meanwhile: Optional[str]) -> None:
    """Between the release's read (the execution's record) and its delete,
    the key changes hands: its lease ran out and another execution took it
    (TAKEN: the other's record, lease and counter untouched), or it was freed
    (FREE: nothing written back)."""
    holder, other = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a")
    theirs: list[Any] = [None]

    def change_hands() -> None:
        vr.delete(keys.lock)
        if meanwhile != "released":
            theirs[0] = granted(other, keys, "task-b", "exec-b", lease_ms=9000)
            theirs.append(record_of(vr, keys))

    interleave(reaper, {1: change_hands})
    status = release_status(reaper, keys, "exec-a", "task-a")
    if meanwhile == "released":
        assert status is Release.FREE and not vr.exists(keys.lock)
    else:
        assert status is Release.TAKEN
        assert record_of(vr, keys) == theirs[1] and 8000 < vr.pttl(keys.lock) <= 9000
        assert counter(vr, keys) == theirs[0]
    assert vr.get(keys.fin) is None


def test_a_release_read_first_does_not_lower_a_counter_raised_meanwhile(engines: Engines,
        reaper: LockEngine, vr: redis.Redis) -> None:
    """The release read a counter below the lock's token and raises it in the
    write that frees the lock, compared with what it read; another writer
    raised it above the token meanwhile: the lock is freed (RELEASED) and the
    counter keeps the higher value and its TTL."""
    holder = engines()
    keys = new_keys()
    token = granted(holder, keys, "task-a", "exec-a")
    vr.set(keys.fence, "5", px=60_000)
    sent = interleave(reaper, {1: lambda: assert_true(vr.set(keys.fence, token + 1000,
                                                             px=60_000) is True)})
    assert release_status(reaper, keys, "exec-a", "task-a") is Release.RELEASED
    assert not vr.exists(keys.lock)
    assert counter(vr, keys) == token + 1000 and 59_000 < vr.pttl(keys.fence) <= 60_000
    assert ("SET", keys.fence, token, "IFEQ", "5", "PX", native_of(reaper).keep_ms) in sent[1]


# -- a renewal that reads again (_renew_read) ------------------------------------------

def test_a_renewal_renews_the_record_as_it_is_after_two_changes(engines: Engines,
        vr: redis.Redis) -> None:
    """The holder's renewal compares the record it wrote: a copy marked it, so
    it reads it again; before its compared renewal lands the record changes
    once more (written again with a new token). The renewal misses, reads
    again and renews the record as it is now: RENEWED, the record untouched
    but for its lease, and the holder compares that record from then on (its
    release frees the key at once and leaves the finish marker)."""
    holder, copier = engines(), engines()
    keys = new_keys()
    token = granted(holder, keys, "task-a", "exec-a", lease_ms=3000)

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    latest: list[str] = []
    sent = interleave(holder, {
        0: copy_marks,
        2: lambda: latest.append(change(vr, keys.lock, lambda r: with_token(r, token + 1, 0))),
    })
    assert holder.renew([(keys.lock, "exec-a", 60_000)]) == [Renew.RENEWED]
    assert record_of(vr, keys) == latest[0] and field(latest[0], "copies") == "1"
    assert 59_000 < vr.pttl(keys.lock) <= 60_000
    assert [c[0][0] for c in sent] == ["SET", "GET", "SET", "GET", "SET"]
    assert native_of(holder).held[(keys.lock, "exec-a")].record == latest[0]
    del sent[:]
    assert holder.release(keys, "exec-a", "task-a") is True
    assert len(sent) == 1, "the release compared the record as it is now, at once"
    assert vr.get(keys.fin) == "task-a"


def test_a_renewal_finds_its_record_handed_off_between_its_read_and_write(engines: Engines,
        vr: redis.Redis) -> None:
    """The renewal read its record again (a copy marked it); before its
    compared renewal lands, the task hands the key off to its retry. The
    renewal misses, reads again and answers HANDED_OFF: the handed record and
    the hand-off's lease stay as they are (not extended to the renewal's)."""
    holder, copier = engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a", lease_ms=3000)

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    def hand_off() -> None:
        record = change(vr, keys.lock, handed)
        assert vr.set(keys.lock, record, px=7000)

    interleave(holder, {0: copy_marks, 2: hand_off})
    assert holder.renew([(keys.lock, "exec-a", 60_000)]) == [Renew.HANDED_OFF]
    record = record_of(vr, keys)
    assert (field(record, "handoff"), field(record, "copies")) == ("1", "1")
    assert 6000 < vr.pttl(keys.lock) <= 7000


def test_a_renewal_leaves_a_key_taken_between_its_read_and_write(engines: Engines,
        vr: redis.Redis) -> None:
    """The renewal read its record again (a copy marked it); before its
    compared renewal lands, its lease ran out and another execution took the
    key. The renewal misses, reads again and answers NOT_OURS, the other's
    record and lease untouched."""
    holder, copier, other = engines(), engines(), engines()
    keys = new_keys()
    granted(holder, keys, "task-a", "exec-a", lease_ms=3000)

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    taken, theirs = taken_by(other, vr, keys, lease_ms=9000)
    interleave(holder, {0: copy_marks, 2: taken})
    assert holder.renew([(keys.lock, "exec-a", 60_000)]) == [Renew.NOT_OURS]
    assert record_of(vr, keys) == theirs[0] and 8000 < vr.pttl(keys.lock) <= 9000


# -- the raise behind a grant (_raise_later) --------------------------------------------

@pytest.mark.parametrize("meanwhile", ["higher", "7", None])
def test_the_raise_behind_a_grant_racing_another_write_leaves_the_maximum(engines: Engines,
        vr: redis.Redis, meanwhile: Optional[str]) -> None:
    """A grant that finds the key's counter below its token raises it right
    behind, compared with the counter it read, without waiting: here the
    same execution asking again (its first reply lost), which always finds
    the counter its first grant left. Before that raise lands, another writer
    sets the counter above the token (it stays, with its TTL), below it, or
    deletes it (the raise, missed, reads the counter and raises it to the
    token when its reply is read): the counter ends at the larger of the two,
    never below the token."""
    first, again = engines(), engines()
    keys = new_keys()
    token = granted(first, keys, "task-a", "exec-a", lease_ms=30_000)
    vr.set(keys.fence, "5", px=60_000)
    other = token + 1000 if meanwhile == "higher" else (
        None if meanwhile is None else int(meanwhile))

    def write() -> None:
        if other is None:
            vr.delete(keys.fence)
        else:
            vr.set(keys.fence, str(other), px=60_000)

    raises = before_raise_behind_grant(again, keys, write)
    got = take(again, keys, "task-a", "exec-a", lease_ms=30_000)
    assert (got.status, got.token) == (Acquire.GRANTED, token)
    again.settle()
    assert raises == [("SET", keys.fence, token, "IFEQ", "5", "PX",
                       fence_ttl_ms(30_000, native_of(again).keep_ms))]
    assert counter(vr, keys) == max(token, other or 0)
    if other is not None and other > token:
        assert 59_000 < vr.pttl(keys.fence) <= 60_000
    else:
        fence_ms = fence_ttl_ms(30_000, native_of(again).keep_ms)
        assert fence_ms - 1000 < vr.pttl(keys.fence) <= fence_ms
    assert again.release(keys, "exec-a", "task-a") is True


# -- a write-back (reclaim) ------------------------------------------------------------

def forgotten(engine: LockEngine, vr: redis.Redis, keys: LockKeys) -> tuple[Request, int]:
    """A lock the engine holds, then forgotten by the server with its counter
    (an empty restart): the write-back's request and the token it held."""
    token = granted(engine, keys, "task-a", "exec-a", lease_ms=30_000)
    vr.delete(keys.lock, keys.fence)
    return Request("task-a", "exec-a", Lease.of_ms(30_000), "w1@host", task_name="t.x"), token


def test_a_write_back_goes_above_a_counter_recreated_meanwhile_into_the_record_as_marked(
        engines: Engines, vr: redis.Redis) -> None:
    """The write-back reads the key free with no counter; before its write,
    another writer creates the counter far above the token it held, so its
    record goes in with a token that does not stand; before that token is
    rewritten, a copy marks the record. The rewrite, compared, misses, reads
    again and writes the counter + 1 into the marked record; the counter is
    raised to it: WRITTEN_BACK with that token."""
    engine, copier = engines(), engines()
    keys = new_keys()
    request, held = forgotten(engine, vr, keys)
    high = held + 10_000_000

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    sent = interleave(engine, {1: lambda: assert_true(vr.set(keys.fence, high, px=60_000)),
                               2: copy_marks})
    back = engine.reclaim(keys, request, held)
    assert (back.status, back.token) == (Reclaim.WRITTEN_BACK, high + 1)
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "token"), field(record, "copies")) == (
        "exec-a", str(high + 1), "1")
    assert counter(vr, keys) == high + 1
    assert [c[0][:2] for c in sent[2:5]] == [("SET", keys.lock), ("GET", keys.lock),
                                            ("SET", keys.lock)]
    assert engine.release(keys, "exec-a", "task-a") is True
    assert record_of(vr, keys) is None and vr.get(keys.fin) == "task-a"


@pytest.mark.parametrize("when", ["before its write", "before its rewrite"])
def test_a_write_back_leaves_a_key_another_execution_took_meanwhile(engines: Engines,
        vr: redis.Redis, when: str) -> None:
    """Another execution takes the key after the write-back read it free:
    before the write-back's write (HELD by the other), or after it, before
    the rewrite of its token (RELEASED: the key is not its own any more).
    Either way the other's record and lease stay as they were, and the first
    execution's release, when it comes, finds the key TAKEN and leaves it."""
    engine, other = engines(), engines()
    keys = new_keys()
    request, held = forgotten(engine, vr, keys)
    taken, theirs = taken_by(other, vr, keys, lease_ms=9000)
    if when == "before its write":
        interleave(engine, {1: taken})
    else:
        # the counter recreated above the token first, so the record is rewritten
        interleave(engine, {1: lambda: assert_true(vr.set(keys.fence, held + 10_000_000,
                                                         px=60_000)), 2: taken})
    back = engine.reclaim(keys, request, held)
    if when == "before its write":
        assert back.status is Reclaim.HELD and back.holder is not None
        assert back.holder.exec_id == "exec-b"
    else:
        assert back.status is Reclaim.RELEASED
    assert record_of(vr, keys) == theirs[0] and 8000 < vr.pttl(keys.lock) <= 9000
    assert release_status(engine, keys, "exec-a", "task-a") is Release.TAKEN
    assert record_of(vr, keys) == theirs[0]


# -- the holder's own lease anew (acquire asked again, reclaim found its own) ------------

def test_an_execution_asking_again_does_not_extend_a_key_taken_after_its_grant_read(
        engines: Engines, vr: redis.Redis) -> None:
    """The same execution asks again (its first grant's reply lost): its grant
    reads its own record, and before it gives that record its lease anew the
    key changes hands (the lease ran out, another execution took it). Its
    lease is given only to its own record, compared (only the holder extends
    it): the other's record and lease stay as they were, and the execution,
    deciding again from the key as it is now, is told HELD."""
    first, again, other = engines(), engines(), engines()
    keys = new_keys()
    granted(first, keys, "task-a", "exec-a", lease_ms=5000)
    taken, theirs = taken_by(other, vr, keys, lease_ms=60_000)
    interleave(again, {0: taken})
    got = take(again, keys, "task-a", "exec-a", lease_ms=3000)
    assert record_of(vr, keys) == theirs[0]
    assert 59_000 < vr.pttl(keys.lock) <= 60_000, "the other's lease not cut to 3 s"
    assert got.status is Acquire.HELD and got.holder is not None
    assert got.holder.exec_id == "exec-b"


def test_an_execution_asking_again_extends_its_record_a_copy_marked_after_the_grant_read(
        engines: Engines, vr: redis.Redis) -> None:
    """The same execution asks again; between its grant's read and its lease
    anew, a copy marks its record. The lease is given to the record as it is
    now (still its own): GRANTED with its token, the mark kept, the lease the
    one asked for."""
    first, again, copier = engines(), engines(), engines()
    keys = new_keys()
    token = granted(first, keys, "task-a", "exec-a", lease_ms=5000)

    def copy_marks() -> None:
        assert take(copier, keys, "task-a", "exec-copy").status is Acquire.SAME_TASK

    interleave(again, {0: copy_marks})
    got = take(again, keys, "task-a", "exec-a", lease_ms=30_000)
    assert (got.status, got.token) == (Acquire.GRANTED, token)
    record = record_of(vr, keys)
    assert (field(record, "exec"), field(record, "copies")) == ("exec-a", "1")
    assert 29_000 < vr.pttl(keys.lock) <= 30_000
    assert again.release(keys, "exec-a", "task-a") is True
    assert vr.get(keys.fin) == "task-a"


def test_a_write_back_finding_its_own_lock_does_not_extend_a_key_taken_after_its_read(
        engines: Engines, vr: redis.Redis) -> None:
    """A write-back reads the key and finds its own lock after all; before it
    gives that lock its lease anew, the key changes hands (the lease ran out,
    another execution took it). Only its own record is extended (compared):
    the other's record and lease stay as they were, and the write-back,
    deciding again, answers HELD, naming the other execution."""
    engine, other = engines(), engines()
    keys = new_keys()
    held = granted(engine, keys, "task-a", "exec-a", lease_ms=5000)
    request = Request("task-a", "exec-a", Lease.of_ms(30_000), "w1@host", task_name="t.x")
    taken, theirs = taken_by(other, vr, keys, lease_ms=9000)
    interleave(engine, {1: taken})
    back = engine.reclaim(keys, request, held)
    assert record_of(vr, keys) == theirs[0]
    assert 8000 < vr.pttl(keys.lock) <= 9000, "the other's lease not set to 30 s"
    assert back.status is Reclaim.HELD and back.holder is not None
    assert back.holder.exec_id == "exec-b"
