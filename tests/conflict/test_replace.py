"""``singleton_on_duplicate="replace"``: a send takes the place of the call
still queued (its arguments win), and ``singleton_debounce`` pushes that
call's start back after each send; on two prefork workers sharing one queue."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from typing import Any, Iterator

import pytest
from celery import chain, chord, group

from celery_singleton_lock import ConfigurationError, SingletonTask, is_deduplicated, is_skipped
from tests.cli.test_cli import run_cli
from tests.support import RedisServer, Worker, discard, marker, wait_for
from tests.workerapp import make_app

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def two_workers(redis_server: Any) -> Iterator[tuple[Worker, Worker]]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    workers = (Worker(redis_server.url(), queue, concurrency=2, name="a").start(),
               Worker(redis_server.url(), queue, concurrency=2, name="b").start())
    yield workers
    for w in workers:
        discard(w)


@pytest.fixture(scope="module")
def app(redis_server: Any, two_workers: tuple[Worker, Worker]) -> Any:
    return make_app(redis_server.url(), two_workers[0].queue)


def parked() -> str:
    """A queue of its own that no worker consumes until :func:`unpark`: its
    calls stay queued however long the CLI commands of a loaded machine take."""
    return f"parked-{uuid.uuid4().hex[:8]}"


def unpark(app: Any, workers: tuple[Worker, Worker], queue: str) -> None:
    """Both workers consume ``queue`` from now on."""
    names = [w.name if "@" in w.name else f"celery@{w.name}" for w in workers]
    replies = app.control.add_consumer(queue, destination=names, reply=True, timeout=10)
    assert len(replies) == len(names), replies


def skipped_by_workers(workers: tuple[Worker, Worker], task_id: str, successor: str) -> bool:
    line = f"[{task_id}] skipped: replaced by {successor} (queued)"
    return any(line in w.logs() for w in workers)


def queued_eta(server: RedisServer, queue: str, task_id: str) -> dt.datetime:
    """The ETA the message of ``task_id`` waiting in ``queue`` (a parked one) carries."""
    for raw in server.client(0).lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        if headers["id"] == task_id:
            return dt.datetime.fromisoformat(headers["eta"])
    raise AssertionError(f"no message of {task_id} in {queue}")


@pytest.mark.parametrize("scope", ["queue", "queue_and_run"])
def test_the_last_send_replaces_the_queued_ones_and_runs_alone(app, two_workers, events, key,
                                                               scope):
    """Three sends while the first is queued: the last one's arguments run,
    once; the two before it get, at once, skip results naming the send that
    took each one's place, and their messages are skipped as "replaced" when
    they reach a worker."""
    t = app.tasks[f"t.{scope}_replace"]
    queue = parked()
    first = t.apply_async((key, 0.0, "first"), queue=queue)
    second = t.apply_async((key, 0.0, "second"), queue=queue)
    third = t.apply_async((key, 0.0, "third"), queue=queue)
    assert not any(is_deduplicated(x) for x in (first, second, third))
    # stored by the send that replaced them: no worker has had their messages yet
    assert first.ready() and second.ready()
    for old, successor in ((first, second), (second, third)):
        result = old.get(timeout=1)
        assert is_skipped(result), result
        assert (result["reason"], result["holder"], result["state"]) == (
            "replaced", successor.id, "queued")
        assert result["key"] == t.singleton_keys(key).base
    unpark(app, two_workers, queue)
    assert third.get(timeout=10)["tag"] == "third"
    wait_for(lambda: skipped_by_workers(two_workers, first.id, second.id)
             and skipped_by_workers(two_workers, second.id, third.id), 15,
             what="the workers to skip both")
    assert [e["tag"] for e in events.starts()] == ["third"]


@pytest.mark.parametrize("canvas", ["chain", "group", "chord"])
def test_a_canvas_member_never_replaces_the_queued_call(app, two_workers, events, key, r,
                                                        canvas):
    """A member of a chain, group or chord sent while a call is queued is sent
    without taking the key: the queued call keeps its place and its arguments
    (its caller is told nothing), and runs; the member meets it at run."""
    t = app.tasks["t.queue_replace"]
    queue = parked()
    first = t.apply_async((key, 0.0, "first"), queue=queue)
    queued = t.singleton_keys(key).queued
    assert marker(r, queued) == ("t.queue_replace", first.id)
    member = t.si(key, 0.0, "member").set(queue=queue)
    plain = app.tasks["t.plain"].si(key, 0.0, "plain").set(queue=queue)
    if canvas == "chain":
        sent = chain(member, plain).apply_async()
    elif canvas == "group":
        sent = group(member, plain).apply_async()
    else:
        sent = chord([member, plain], app.tasks["t.collect"].s()).apply_async()
    # a send that replaced it would have stored its skip result and moved the key
    assert not first.ready(), first.get(timeout=1)
    assert marker(r, queued) == ("t.queue_replace", first.id)
    unpark(app, two_workers, queue)
    assert first.get(timeout=15)["tag"] == "first"
    sent.get(timeout=15)
    assert [e["tag"] for e in events.starts("first")] == ["first"]
    assert not any(f"[{first.id}] skipped: replaced" in w.logs() for w in two_workers)


def test_the_cli_lists_the_queued_marker_s_new_holder(app, two_workers, events, key):
    t = app.tasks["t.queue_replace"]
    queue = parked()
    first = t.apply_async((key, 0.0, "first"), queue=queue)
    second = t.apply_async((key, 0.0, "second"), queue=queue)
    out = run_cli(two_workers[0].env, "list", "--state", "queued", "--json")
    assert out.returncode == 0, out.stderr
    base = t.singleton_keys(key).base
    rows = [row for row in json.loads(out.stdout)["locks"] if row["key"] == base]
    assert [(row["holder"], row["task"]) for row in rows] == [(second.id, "t.queue_replace")]
    # the record of the replaced call: its task, the call in its place, how many
    out = run_cli(two_workers[0].env, "list", "--state", "replaced", "--task",
                  "t.queue_replace", "--json")
    assert out.returncode == 0, out.stderr
    rows = [row for row in json.loads(out.stdout)["locks"] if row["key"] == base]
    assert [(row["state"], row["holder"], row["superseded"]) for row in rows] == [
        ("replaced", second.id, 1)]
    assert rows[0]["ttl"] > 0
    table = run_cli(two_workers[0].env, "list", "--state", "replaced").stdout
    assert any(base in line and second.id in line and "1 superseded" in line
               for line in table.splitlines()), table
    assert first.get(timeout=1)["holder"] == second.id
    unpark(app, two_workers, queue)
    assert second.get(timeout=10)["tag"] == "second"
    wait_for(lambda: skipped_by_workers(two_workers, first.id, second.id), 15,
             what="the worker to skip the first")


def test_purge_keeps_the_record_of_a_replaced_call(app, two_workers, events, key, r):
    """`purge --yes` keeps the record that a call was replaced (its caller was
    told so) as it keeps the queued call's key; with that key freed, the
    replaced call's message, reaching a worker after the purge, is still
    skipped, not run with the old arguments."""
    t = app.tasks["t.queue_replace"]
    queue = parked()  # queued until the CLI commands are done
    first = t.apply_async((key, 0.0, "first"), queue=queue)
    second = t.apply_async((key, 0.0, "second"), queue=queue)
    assert first.get(timeout=1)["holder"] == second.id
    out = run_cli(two_workers[0].env, "purge", "--task", "t.queue_replace", "--yes", "--json")
    assert out.returncode == 1, out.stdout + out.stderr  # the queued call's key was kept
    base = t.singleton_keys(key).base
    assert [(e["state"], e["action"]) for e in json.loads(out.stdout)["keys"]
            if e["key"] == base] == [("queued", "kept: queued"), ("replaced", "kept: callers told")]
    freed = run_cli(two_workers[0].env, "release", base, "--force")
    assert freed.returncode == 0, freed.stdout + freed.stderr
    assert r.exists(t.singleton_keys(key).replaced)
    unpark(app, two_workers, queue)
    assert second.get(timeout=30)["tag"] == "second"
    wait_for(lambda: skipped_by_workers(two_workers, first.id, second.id), 15,
             what="the worker to skip the replaced call after the purge")
    assert [e["tag"] for e in events.starts()] == ["second"]
    # --force deletes the record too, when its superseded messages are known gone
    out = run_cli(two_workers[0].env, "purge", "--task", "t.queue_replace", "--yes", "--force",
                  "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [(e["state"], e["action"]) for e in json.loads(out.stdout)["keys"]
            if e["key"] == base] == [("replaced", "deleted")]
    assert not r.exists(t.singleton_keys(key).replaced)


def test_queue_a_send_after_the_holder_started_is_accepted_and_waits(app, events, key):
    t = app.tasks["t.queue_replace"]
    first = t.delay(key, 1.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="the first start")
    second = t.delay(key, 0.0, "second")
    assert not is_deduplicated(second)
    assert second.get(timeout=15)["tag"] == "second"
    assert first.get(timeout=5)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first", "second"]
    assert all(e["concurrent"] == 1 for e in events.starts())


def test_queue_and_run_a_send_after_the_holder_started_is_refused(app, events, key):
    t = app.tasks["t.queue_and_run_replace"]
    first = t.delay(key, 1.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="the first start")
    dup = t.delay(key, 0.0, "dup")
    assert is_deduplicated(dup) and dup.id == first.id and dup.reason == "duplicate"
    assert dup.get(timeout=10)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]


def test_debounce_runs_the_last_of_a_burst_after_it_goes_quiet(app, events, key):
    """Sends closer together than ``singleton_debounce`` (1 s): one run, the
    last send's, no earlier than a debounce after that send."""
    t = app.tasks["t.debounce"]
    sent = []
    for i in range(5):
        before = time.time()
        sent.append((before, t.delay(key, 0.0, f"s{i}")))
        time.sleep(0.2)
    last_sent, last = sent[-1]
    assert last.get(timeout=15)["tag"] == "s4"
    for (_, old), (_, successor) in zip(sent, sent[1:]):
        result = old.get(timeout=1)
        assert is_skipped(result) and result["reason"] == "replaced"
        assert result["holder"] == successor.id
    starts = events.starts()
    assert [e["tag"] for e in starts] == ["s4"]
    assert starts[0]["t"] >= last_sent + 1.0, (starts[0]["t"], last_sent)


@pytest.mark.parametrize("own", ["countdown", "eta"])
def test_a_debounced_send_with_a_countdown_or_eta_of_its_own_keeps_it(
        app, two_workers, redis_server, events, key, own):
    """``singleton_debounce`` (1 s) gives a send a countdown only when it has
    none: a send with a ``countdown`` or ``eta`` of its own (3 s) keeps it, as
    the message it puts in the queue says; the send before it got the debounce."""
    t = app.tasks["t.debounce"]
    queue = parked()  # the messages stay in the broker's list, to be read
    before = app.now()
    first = t.apply_async((key, 0.0, "first"), queue=queue)
    own_eta = app.now() + dt.timedelta(seconds=3)
    option: dict[str, Any] = {"countdown": 3} if own == "countdown" else {"eta": own_eta}
    mid = app.now()
    second = t.apply_async((key, 0.0, "second"), queue=queue, **option)
    after = app.now()
    debounce, countdown = dt.timedelta(seconds=1), dt.timedelta(seconds=3)
    # the debounced send: the debounce's countdown, given by this send
    assert before + debounce <= queued_eta(redis_server, queue, first.id) <= mid + debounce
    if own == "countdown":
        assert mid + countdown <= queued_eta(redis_server, queue, second.id) <= after + countdown
    else:
        assert queued_eta(redis_server, queue, second.id) == own_eta
    assert first.get(timeout=1)["holder"] == second.id  # it replaced the first all the same
    unpark(app, two_workers, queue)
    assert second.get(timeout=15)["tag"] == "second"
    assert [e["tag"] for e in events.starts()] == ["second"]


def test_debounce_max_starts_the_call_while_the_sends_go_on(app, events, key):
    """A burst that never goes quiet still runs: no later than
    ``singleton_debounce_max`` after its first send, before the latest send
    made ahead of the start has had its debounce."""
    t = app.tasks["t.debounce_max"]
    sent: list[tuple[float, Any]] = []
    deadline = time.monotonic() + 20
    while not events.starts() and time.monotonic() < deadline:
        sent.append((time.time(), t.delay(key, 0.0, f"s{len(sent)}")))
        time.sleep(0.2)
    starts = events.starts()
    assert starts, "the burst never started: nothing caps the debounce"
    first_start = starts[0]["t"]
    before = [at for at, _ in sent if at < first_start]
    assert first_start >= sent[0][0] + 1.0
    assert first_start < max(before) + 1.0, (first_start, max(before))
    for _, result in sent:
        result.get(timeout=15)


def test_replace_is_refused_under_the_run_scope_and_debounce_needs_it():
    from celery import Celery

    bad = Celery("bad", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @bad.task(base=SingletonTask, name="bad.replace", singleton_on_duplicate="replace",
              shared=False)
    def replace_run() -> None:
        pass

    @bad.task(base=SingletonTask, name="bad.debounce", singleton_scope="queue",
              singleton_debounce=1, shared=False)
    def debounce_skip() -> None:
        pass

    @bad.task(base=SingletonTask, name="bad.debounce_max", singleton_scope="queue",
              singleton_on_duplicate="replace", singleton_debounce=2, singleton_debounce_max=1,
              shared=False)
    def short_cap() -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"singleton_on_duplicate.*singleton_scope"):
        bad.tasks["bad.replace"].singleton_settings()
    with pytest.raises(ConfigurationError, match=r"singleton_debounce.*'replace'"):
        bad.tasks["bad.debounce"].singleton_settings()
    with pytest.raises(ConfigurationError, match="singleton_debounce_max"):
        bad.tasks["bad.debounce_max"].singleton_settings()
