"""Scopes on a real prefork worker: dedupe at send ("queue"), hold from send to
finish ("queue_and_run"), the done window, and canvases with duplicate members."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from celery_singleton_lock import (
    DuplicateTaskError,
    LockBackendError,
    is_deduplicated,
    is_skipped,
)
from tests.support import Worker, discard, marker, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


def never_sent(app: Any, task_id: str) -> bool:
    """No message with this id ever reached a worker or the result backend."""
    return AsyncResult(task_id, app=app).state == "PENDING"


def test_queue_scope_refuses_a_duplicate_while_one_is_queued(client_app, events, key, r):
    t = client_app.tasks["t.queue"]
    first = t.apply_async((key, 0.2, "first"), countdown=1.5)
    dups = [t.delay(key, 0.0, f"dup{i}") for i in range(4)]
    for d in dups:
        assert is_deduplicated(d)
        assert d.id == first.id and d.holder == first.id and d.reason == "duplicate"
        assert d.refused_id != first.id
    # The refused sends return the holder's own result.
    assert dups[0].get(timeout=10)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]
    assert all(never_sent(client_app, d.refused_id) for d in dups)
    assert not is_deduplicated(first)


def test_queue_scope_a_send_accepted_while_one_runs_waits_and_then_runs(client_app, events, key):
    """The key frees when the queued one starts, so a send made while it runs is
    accepted (the data may have changed after the run began). That send must
    run: it waits for the running one to end, then runs, never beside it."""
    t = client_app.tasks["t.queue"]
    first = t.delay(key, 3.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="first start")
    second = t.delay(key, 0.0, "second")
    assert not is_deduplicated(second)
    # while the second waits, it is the one queued: a third send joins it
    third = t.delay(key, 0.0, "third")
    assert is_deduplicated(third) and third.id == second.id
    result = second.get(timeout=20)
    assert not is_skipped(result) and result["tag"] == "second"
    first.get(timeout=10)
    assert [e["tag"] for e in events.starts()] == ["first", "second"]
    ends = events.ends("first")
    assert ends and events.all().index(ends[0]) < events.all().index(events.starts("second")[0])
    assert all(e["concurrent"] == 1 for e in events.starts())


def test_queue_and_run_refuses_while_queued_and_while_running(client_app, events, key):
    t = client_app.tasks["t.queue_and_run"]
    first = t.apply_async((key, 1.5, "first"), countdown=0.5)
    queued_dup = t.delay(key, 0.0, "dup-queued")
    assert is_deduplicated(queued_dup) and queued_dup.id == first.id
    wait_for(lambda: events.starts("first"), 10, what="first start")
    running_dup = t.delay(key, 0.0, "dup-running")
    assert is_deduplicated(running_dup) and running_dup.id == first.id
    assert running_dup.get(timeout=10)["tag"] == "first"
    # Finished: the key is free again.
    after = t.delay(key, 0.0, "after")
    assert not is_deduplicated(after)
    assert after.get(timeout=10)["tag"] == "after"
    assert [e["tag"] for e in events.starts()] == ["first", "after"]


def test_queue_and_run_hands_the_key_to_the_execution_without_a_gap(client_app, events, key):
    """Sends hammer the key while the first waits, starts, runs and ends: every one
    of them is refused with the first's id until the first has finished."""
    t = client_app.tasks["t.queue_and_run"]
    first = t.apply_async((key, 0.8, "first"), countdown=0.5)
    refused: list[str] = []
    sent: list[tuple[float, Any]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            res = t.delay(key, 0.0, "dup")
            if is_deduplicated(res):
                refused.append(res.id)
            else:
                sent.append((time.monotonic(), res))
                return

    thread = threading.Thread(target=hammer)
    thread.start()
    first.get(timeout=15)
    finished_at = time.monotonic()
    thread.join(10)
    stop.set()
    assert len(refused) > 20
    assert set(refused) == {first.id}
    # The first send that got through came only after the first run ended.
    assert len(sent) == 1 and sent[0][0] >= finished_at - 0.5
    sent[0][1].get(timeout=10)
    starts = events.starts()
    assert [e["tag"] for e in starts] == ["first", "dup"]
    assert all(e["concurrent"] == 1 for e in starts)


def test_queue_scope_raise_and_retry_policies_at_send(client_app, events, key):
    raiser = client_app.tasks["t.queue_and_run_raise"]
    first = raiser.apply_async((key, 0.5, "first"), countdown=0.3)
    with pytest.raises(DuplicateTaskError) as info:
        raiser.delay(key, 0.0, "dup")
    assert first.id in str(info.value)
    wait_for(lambda: events.starts("first"), 10, what="first start")
    with pytest.raises(DuplicateTaskError) as running:
        raiser.delay(key, 0.0, "dup")
    assert running.value.state == "running"
    assert "is already running under key" in str(running.value)
    first.get(timeout=10)

    waiter = client_app.tasks["t.queue_and_run_retry"]
    holder = waiter.delay(key + "w", 1.0, "holder")
    wait_for(lambda: events.starts("holder"), 10, what="holder start")
    late = waiter.delay(key + "w", 0.0, "late")
    assert not is_deduplicated(late)  # "retry" never drops: it is sent and waits
    assert late.get(timeout=15)["tag"] == "late"
    holder.get(timeout=10)
    ends = {e["tag"]: e for e in events.all() if e["ev"] == "end"}
    late_start = [e for e in events.all() if e["ev"] == "start" and e["tag"] == "late"]
    assert len(late_start) == 1 and late_start[0]["concurrent"] == 1
    assert "holder" in ends


def test_raise_at_send_says_the_holder_is_queued_when_no_worker_took_it(redis_server, r, key):
    """No worker reads this queue: the holder never started, and the error says so."""
    app = make_app(redis_server.url(), f"nobody-{key}")
    try:
        t = app.tasks["t.queue_raise"]
        first = t.delay(key, 0.0, "first")
        with pytest.raises(DuplicateTaskError) as info:
            t.delay(key, 0.0, "dup")
        assert info.value.holder == first.id and info.value.state == "queued"
        assert "is already queued under key" in str(info.value)
        assert "running" not in str(info.value)
    finally:
        redis_server.client(0).delete(f"nobody-{key}")
        app.close()


def test_far_eta_keeps_the_key_and_revoke_frees_it(client_app, events, key, r):
    t = client_app.tasks["t.queue"]
    far = t.apply_async((key, 0.0, "far"), countdown=120)
    lock_key = t.singleton_keys(key, 0.0, "far").queued
    assert marker(r, lock_key) == ("t.queue", far.id)
    # Lasts past the ETA, however far, plus the queue grace.
    assert r.pttl(lock_key) > 120_000
    assert is_deduplicated(t.delay(key, 0.0, "dup"))
    far.revoke()
    wait_for(lambda: r.get(lock_key) is None, 10, what="revoked task's key to free")
    again = t.delay(key, 0.0, "again")
    assert not is_deduplicated(again)
    assert again.get(timeout=10)["tag"] == "again"
    assert [e["tag"] for e in events.starts()] == ["again"]


def test_one_revoke_of_several_queued_tasks_frees_each_key(client_app, events, key, r):
    """``app.control.revoke([id, id])`` (and ``GroupResult.revoke()``) revokes
    several tasks in one command: the send-time key of each frees at once,
    not at its far ETA."""
    t = client_app.tasks["t.queue"]
    far = [t.apply_async((f"{key}-{i}", 0.0, f"far{i}"), countdown=120) for i in range(2)]
    # the key's argument by name: the key freed is the one it was sent under
    far.append(t.apply_async(kwargs={"key": f"{key}-2", "tag": "far2"}, countdown=120))
    queued = [t.singleton_keys(f"{key}-{i}", 0.0, f"far{i}").queued for i in range(3)]
    assert [marker(r, k) for k in queued] == [("t.queue", f.id) for f in far]
    client_app.control.revoke([f.id for f in far])
    wait_for(lambda: all(r.get(k) is None for k in queued), 10,
             what="each revoked task's key to free")
    again = t.delay(f"{key}-1", 0.0, "again")
    assert not is_deduplicated(again)
    assert again.get(timeout=10)["tag"] == "again"
    assert [e["tag"] for e in events.starts()] == ["again"]


def test_a_revoke_of_a_task_the_worker_never_had_is_answered_as_celery_answers_it(
        client_app, key):
    """A revoke goes to every worker, most of which never had the task: the
    watch on the command finds no request there and frees nothing, and the
    command's reply is Celery's own, not an error."""
    import uuid

    replies = client_app.control.revoke(str(uuid.uuid4()), reply=True, timeout=5)
    assert replies, "no worker answered the revoke"
    for reply in replies:
        for worker, answer in reply.items():
            assert "ok" in answer and "error" not in answer, (worker, answer)


@pytest.mark.parametrize("when", ["countdown", "eta", "eta-iso"])
def test_the_send_time_key_lasts_past_the_eta_plus_the_queue_ttl(redis_server, r, key, when):
    """A message sent for an hour from now keeps its key until then plus
    ``singleton_queue_ttl`` (300 s): the delay is counted whatever form it is
    given in, so an hour-off ETA is not left keyless after five minutes. No
    worker reads the queue: the message stays there."""
    import datetime as dt

    app = make_app(redis_server.url(), f"nobody-{key}")
    try:
        t = app.tasks["t.queue"]
        queue_ttl = t.singleton_settings().config.queue_ttl
        assert queue_ttl == 300.0
        hour = 3600
        eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=hour)
        options: dict[str, Any] = {"countdown": {"countdown": hour}, "eta": {"eta": eta},
                                   "eta-iso": {"eta": eta.isoformat()}}[when]
        sent = t.apply_async((key, 0.0, "far"), **options)
        keys = t.singleton_keys(key)
        assert marker(r, keys.queued) == ("t.queue", sent.id)
        most = (hour + queue_ttl) * 1000
        # the time since the send is all that may be missing from the TTL
        assert most - 60_000 < r.pttl(keys.queued) <= most
    finally:
        redis_server.client(0).delete(f"nobody-{key}")
        app.close()


def test_lost_queued_message_frees_its_key_within_the_queue_ttl(redis_server, r, key):
    """A purged queue leaves no key behind for longer than singleton_queue_ttl."""
    app = make_app(redis_server.url(), f"nobody-{key}", conf={"singleton_queue_ttl": 1.0})
    t = app.tasks["t.queue_and_run"]
    lost = t.delay(key, 0.0, "lost")
    assert is_deduplicated(t.delay(key, 0.0, "dup"))
    with app.connection_for_write() as conn:
        purged = app.amqp.queues[f"nobody-{key}"].bind(conn.default_channel).purge()
    assert purged == 1
    assert marker(r, t.singleton_keys(key).queued) == (t.name, lost.id)
    started = time.monotonic()
    wait_for(lambda: not is_deduplicated(t.delay(key, 0.0, "next")), 5,
             what="the orphaned key to free")
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("scope", ["queue", "queue_and_run"])
def test_retries_keep_the_key_under_queue_scopes(client_app, events, key, scope):
    t = client_app.tasks[f"t.{scope}_retrier"]
    first = t.delay(key, 1, 1.5, 0.0, "r")
    wait_for(lambda: events.ends("r#0"), 10, what="first attempt")
    dup = t.delay(key, 1, 0.0, 0.0, "dup")
    if scope == "queue_and_run":
        assert is_deduplicated(dup) and dup.id == first.id
        assert first.get(timeout=15)["tag"] == "r#1"
        assert [e["tag"] for e in events.starts()] == ["r#0", "r#1"]
    else:
        # Accepted (the key freed when the first started); the key kept for the
        # first's retry makes it wait, and it runs once the first is done.
        assert not is_deduplicated(dup)
        assert dup.get(timeout=20)["tag"] == "dup#1"
        assert first.get(timeout=15)["tag"] == "r#1"
        assert [e["tag"] for e in events.starts()] == ["r#0", "r#1", "dup#0", "dup#1"]


@pytest.mark.parametrize("name", ["t.hold", "t.queue", "t.queue_and_run"])
def test_chord_with_duplicate_members_completes(client_app, events, key, name):
    t = client_app.tasks[name]
    collect = client_app.tasks["t.collect"]
    result = chord([t.s(key, 1.5, "m1"), t.s(key, 1.0, "m2").set(countdown=1),
                    t.s(key + "x", 0.1, "other")], collect.s()).apply_async()
    members = result.get(timeout=30)
    assert len(members) == 3
    skipped = [m for m in members if is_skipped(m)]
    ran = sorted(m["tag"] for m in members if not is_skipped(m))
    dups = [e for e in events.starts() if e["tag"] in ("m1", "m2")]
    assert all(e["concurrent"] == 1 for e in dups), dups  # never side by side
    if name == "t.queue" and not skipped:
        # Both ran, one after the other. Either m2 (a canvas member: sent
        # without the key) started first, m1 being held back on a busy worker:
        # m1 took the key when it was sent, so it is an accepted send, which
        # waits for m2 and then runs; or m1 ran first and m2, held back past
        # its countdown on a busy worker, started once m1 had ended.
        assert ran == ["m1", "m2", "other"]
        order = [(e["ev"], e["tag"]) for e in events.all() if e.get("tag") in ("m1", "m2")
                 and e["ev"] in ("start", "end")]
        first, second = (order[0][1], "m2" if order[0][1] == "m1" else "m1")
        assert order == [("start", first), ("end", first), ("start", second),
                         ("end", second)], order
        return
    assert len(skipped) == 1 and ran in (["m1", "other"], ["m2", "other"])
    assert len(dups) == 1


def test_chord_body_whose_key_is_taken_still_answers(client_app, events, key):
    """The body of a chord is sent by the worker; refusing it would hang the chord."""
    t = client_app.tasks["t.plain"]
    collect = client_app.tasks["t.collect"]
    expected = [{"tag": "a"}, {"tag": "b"}]
    holder = collect.apply_async((expected,), countdown=3)
    result = chord([t.s(key, 0.0, "a"), t.s(key, 0.0, "b")], collect.s()).apply_async()
    body = result.get(timeout=15)
    assert is_skipped(body) and body["holder"] == holder.id
    assert holder.get(timeout=10) == expected


@pytest.mark.parametrize("name", ["t.hold", "t.queue_and_run"])
def test_group_and_chain_with_duplicate_members_complete(client_app, events, key, name):
    t = client_app.tasks[name]
    g = group(t.s(key, 0.8, "g1"), t.s(key, 0.8, "g2")).apply_async()
    results = g.get(timeout=20)
    assert sum(1 for x in results if is_skipped(x)) == 1
    # A chain whose second link meets the key its first link still holds is
    # not left hanging either.
    holder = t.delay(key + "c", 1.5, "c-holder")
    wait_for(lambda: events.starts("c-holder"), 10, what="chain key holder start")
    res = chain(client_app.tasks["t.plain"].s(key, 0.0, "p"),
                t.si(key + "c", 0.0, "c-dup")).apply_async()
    last = res.get(timeout=15)
    assert is_skipped(last) and last["holder"] == holder.id
    holder.get(timeout=10)


@pytest.mark.parametrize("name", ["t.run_done", "t.queue_done", "t.queue_and_run_done"])
def test_done_window_skips_repeats_and_points_to_the_run_that_did_the_work(
        client_app, events, key, name):
    t = client_app.tasks[name]
    failed = t.delay(key, 0.0, "fails", True)
    with pytest.raises(ValueError):
        failed.get(timeout=10)
    # A failure does not mark the key done: the next call runs.
    work = t.delay(key, 0.0, "work")
    assert work.get(timeout=10)["tag"] == "work"
    repeat = t.delay(key, 0.0, "repeat")
    if name == "t.run_done":
        result = repeat.get(timeout=10)
        assert is_skipped(result)
        assert result["holder"] == work.id and result["reason"] == "done"
    else:
        # refused at send: the caller gets the result of the run that did the work
        assert is_deduplicated(repeat) and repeat.reason == "done"
        assert repeat.id == work.id and repeat.get(timeout=5)["tag"] == "work"
    assert [e["tag"] for e in events.starts()] == ["fails", "work"]
    # The window closes (3 s here): the next call runs again.
    time.sleep(3.2)
    assert t.delay(key, 0.0, "later").get(timeout=10)["tag"] == "later"


@pytest.mark.parametrize("name", ["t.queue", "t.queue_and_run"])
def test_a_done_marker_left_from_before_the_window_was_turned_off_does_not_skip(
        client_app, events, key, r, name):
    """A queue-scope task without a done window neither looks for a done marker
    when sent nor when it starts: one left over (its window since turned off)
    lets the call through, and it runs."""
    t = client_app.tasks[name]
    done = t.singleton_keys(key).done
    r.set(done, f"{name}\nearlier-run", px=60_000)
    sent = t.delay(key, 0.0, "now")
    assert not is_deduplicated(sent)
    assert sent.get(timeout=10)["tag"] == "now"
    assert [e["tag"] for e in events.starts()] == ["now"]
    assert r.get(done) == f"{name}\nearlier-run"  # looked past, not touched


def test_done_window_survives_a_worker_restart(redis_server, events, key):
    queue = f"restart-{key}"
    app = make_app(redis_server.url(), queue)
    t = app.tasks["t.run_done_long"]
    w1 = Worker(redis_server.url(), queue, pool="solo").start()
    try:
        work = t.delay(key, 0.0, "work")
        assert work.get(timeout=10)["tag"] == "work"
    finally:
        w1.stop()
    w2 = Worker(redis_server.url(), queue, pool="solo").start()
    try:
        result = t.delay(key, 0.0, "after-restart").get(timeout=10)
    finally:
        discard(w2)
    assert is_skipped(result) and result["holder"] == work.id and result["reason"] == "done"
    assert [e["tag"] for e in events.starts()] == ["work"]


@pytest.mark.parametrize("name", ["t.queue", "t.queue_and_run"])
def test_resending_the_same_task_id_is_a_duplicate(client_app, events, key, name):
    """Callers that use their idempotency key as task id send it once."""
    t = client_app.tasks[name]
    event_id = f"evt-{key}"
    first = t.apply_async((key, 0.5, "first"), task_id=event_id, countdown=0.3)
    again = t.apply_async((key, 0.0, "again"), task_id=event_id)
    assert not is_deduplicated(first)
    assert is_deduplicated(again) and again.id == event_id
    assert first.get(timeout=10)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]


def test_lock_redis_down_at_send_sends_anyway_or_raises(redis_server, prefork_worker, events,
                                                       key):
    """No send-time key without Redis: the task is still sent (and locked when it
    runs), or, with on_backend_error="raise", the caller gets LockBackendError."""
    from tests.support import dead_port

    dead = f"redis://127.0.0.1:{dead_port()}/2"
    app = make_app(redis_server.url(), prefork_worker.queue, lock_url=dead)
    t = app.tasks["t.queue_and_run"]
    sent = t.delay(key, 0.0, "sent")
    assert not is_deduplicated(sent)
    assert sent.get(timeout=10)["tag"] == "sent"
    assert [e["tag"] for e in events.starts()] == ["sent"]

    strict = make_app(redis_server.url(), prefork_worker.queue, lock_url=dead,
                      conf={"singleton_on_backend_error": "raise"})
    with pytest.raises(LockBackendError):
        strict.tasks["t.queue_and_run"].delay(key, 0.0, "never")
    # a call sent after it ran: had "never" been sent, it would have come first
    assert t.delay(f"{key}-after", 0.0, "after").get(timeout=10)["tag"] == "after"
    assert [e["tag"] for e in events.starts()] == ["sent", "after"]


def test_a_send_the_broker_refused_frees_the_key_it_took(redis_server, prefork_worker,
                                                         client_app, events, key, r):
    """The send-time key is taken, then the broker refuses the message: the
    caller gets the broker's error and the key is freed at once, so the next
    send of the call is not refused in favour of a task that was never sent."""
    from tests.support import dead_port

    no_broker = make_app(redis_server.url(), prefork_worker.queue,
                         lock_url=redis_server.url(2),
                         conf={"broker_url": f"redis://127.0.0.1:{dead_port()}/0"})
    t = no_broker.tasks["t.queue"]
    queued = t.singleton_keys(key, 0.0, "lost").queued
    with pytest.raises(Exception) as info:
        t.apply_async((key, 0.0, "lost"), retry=False)
    assert not isinstance(info.value, LockBackendError), info.value
    assert r.get(queued) is None
    again = client_app.tasks["t.queue"].delay(key, 0.0, "again")
    assert not is_deduplicated(again)
    assert again.get(timeout=10)["tag"] == "again"
    assert [e["tag"] for e in events.starts()] == ["again"]


def test_send_whose_reply_was_lost_is_still_sent_once(redis_server, prefork_worker, events,
                                                      key):
    """The send-time key was taken but its answer lost with the connection: the
    task is sent all the same, exactly once."""
    from tests.support import ReplyDroppingProxy

    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        app = make_app(redis_server.url(), prefork_worker.queue, lock_url=proxy.url(2))
        t = app.tasks["t.queue_and_run"]
        t.delay(key + "-warm", 0.0, "warm").get(timeout=10)  # scripts loaded
        proxy.drop_after = b"EVALSHA"
        sent = t.delay(key, 0.3, "sent")
        assert proxy.dropped == 1
        assert not is_deduplicated(sent)
        assert is_deduplicated(t.delay(key, 0.0, "dup"))
        assert sent.get(timeout=10)["tag"] == "sent"
    finally:
        proxy.close()
    assert [e["tag"] for e in events.starts()] == ["warm", "sent"]


def test_send_task_through_the_library_takes_the_key_at_send(client_app, events, key):
    from celery_singleton_lock import send_task

    first = send_task(client_app, "t.queue_and_run", (key, 0.5, "first"), countdown=0.2)
    dup = send_task(client_app, "t.queue_and_run", (key, 0.0, "dup"))
    assert not is_deduplicated(first)
    assert is_deduplicated(dup) and dup.id == first.id
    # a name that is no SingletonTask is sent as app.send_task sends it
    plain = send_task(client_app, "t.plain", (key, 0.0, "plain"))
    assert plain.get(timeout=10) == {"tag": "plain"}
    assert first.get(timeout=10)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]
