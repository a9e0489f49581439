"""Duplicates on a real prefork worker: skip, retry, raise; one execution per key."""

from __future__ import annotations

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_singleton_lock import DuplicateTaskError, is_skipped
from celery_singleton_lock.engine.request import Lease, Request

pytestmark = pytest.mark.worker


def test_repeated_callback_runs_once_and_duplicates_are_skipped(client_app, events, key):
    """Five deliveries for one key while the first runs: one execution, four skips
    whose result names the running task."""
    hold = client_app.tasks["t.hold"]
    first = hold.delay(key, 1.5, "first")
    events_started = lambda: events.starts("first")  # noqa: E731
    from tests.support import wait_for

    wait_for(events_started, 10, what="first execution to start")
    dups = [hold.delay(key, 0.0, f"dup{i}") for i in range(4)]
    for d in dups:
        result = d.get(timeout=10)
        assert is_skipped(result), result
        assert result["holder"] == first.id
        assert result["skipped"] is True
    assert first.get(timeout=10)["tag"] == "first"
    assert [e["tag"] for e in events.starts()] == ["first"]


def test_a_skip_is_logged_as_a_skip_not_as_a_success(client_app, prefork_worker, events, key):
    """A worker without -E: one INFO line names the holder and why; Celery's
    "succeeded" line, which would count the skip as a run, is not written."""
    from tests.support import wait_for

    hold = client_app.tasks["t.hold"]
    first = hold.delay(key, 2.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="holder start")
    dup = hold.delay(key, 0.0, "dup")
    assert is_skipped(dup.get(timeout=10))
    first.get(timeout=10)
    # the holder ends, and is logged, after its duplicate was skipped
    wait_for(lambda: f"t.hold[{first.id}] succeeded" in prefork_worker.logs(), 10,
             what="the holder's success line")
    lines = [line for line in prefork_worker.logs().splitlines() if dup.id in line]
    skips = [line for line in lines if "skipped" in line]
    assert len(skips) == 1, lines
    assert "INFO" in skips[0], skips
    assert f"Task t.hold[{dup.id}] skipped: duplicate of {first.id} (running)" in skips[0]
    assert not [line for line in lines if "succeeded" in line or "ignored" in line], lines


def test_skip_answers_at_once_while_holder_still_runs(client_app, events, key):
    """The caller of a skipped duplicate gets its answer before the holder ends."""
    hold = client_app.tasks["t.hold"]
    first = hold.delay(key, 4.0, "long")
    from tests.support import wait_for

    wait_for(lambda: events.starts("long"), 10, what="holder start")
    dup = hold.delay(key, 0.0, "dup")
    assert dup.get(timeout=3)["holder"] == first.id
    assert not first.ready()
    first.get(timeout=10)


def test_different_keys_run_concurrently(client_app, events, key):
    hold = client_app.tasks["t.hold"]
    a = hold.delay(key + "a", 1.0, "a")
    b = hold.delay(key + "b", 1.0, "b")
    assert a.get(timeout=10)["tag"] == "a"
    assert b.get(timeout=10)["tag"] == "b"
    assert sorted(e["tag"] for e in events.starts()) == ["a", "b"]


def test_key_is_free_again_after_success(client_app, events, key):
    hold = client_app.tasks["t.hold"]
    first = hold.delay(key, 0.0, "one").get(timeout=10)
    second = hold.delay(key, 0.0, "two").get(timeout=10)
    assert first["tag"] == "one" and second["tag"] == "two"
    assert second["token"] > first["token"]


def test_key_is_free_again_after_exception(client_app, events, key):
    hold = client_app.tasks["t.hold"]
    with pytest.raises(ValueError):
        hold.delay(key, 0.0, "boom", True).get(timeout=10)
    assert hold.delay(key, 0.0, "after").get(timeout=10)["tag"] == "after"


def test_retry_policy_runs_duplicate_after_holder(client_app, events, key):
    """`retry`: the duplicate waits and runs once the holder is done; never dropped,
    never concurrent."""
    task = client_app.tasks["t.hold_retry"]
    first = task.delay(key, 1.5, "first")
    from tests.support import wait_for

    wait_for(lambda: events.starts("first"), 10, what="holder start")
    dups = [task.delay(key, 0.2, f"dup{i}") for i in range(3)]
    assert first.get(timeout=15)["tag"] == "first"
    tags = sorted(d.get(timeout=30)["tag"] for d in dups)
    assert tags == ["dup0", "dup1", "dup2"]
    starts = events.starts()
    assert len(starts) == 4
    assert max(e["concurrent"] for e in starts) == 1


def test_a_duplicates_waits_grow_from_the_retry_delay_to_its_ceiling(
        client_app, prefork_worker, events, key):
    """`retry`: a duplicate's nth round waits ``singleton_retry_delay`` x 2^n
    (0.2 s in the test app), to ``singleton_retry_max_delay`` (1 s), each +-20%:
    read from the worker's line for each round (``... sent again in 0.4 s``)."""
    import re

    from tests.support import wait_for

    task = client_app.tasks["t.hold_retry"]
    first = task.delay(key, 60.0, "first")
    wait_for(lambda: events.starts("first"), 10, what="holder start")
    dup = task.delay(key, 0.0, "dup")

    def rounds() -> list[float]:
        return [float(n) for n in re.findall(
            rf"Task t\.hold_retry\[{dup.id}\] waits: duplicate of .*; sent again in "
            r"([\d.]+) s", prefork_worker.logs())]

    got = wait_for(lambda: len(rounds()) >= 5 and rounds(), 30, what="five rounds of waiting")
    first.revoke(terminate=True)
    for n, countdown in enumerate(got[:5]):
        delay = min(0.2 * 2 ** n, 1.0)
        # the line rounds to 0.1 s
        assert 0.8 * delay - 0.05 <= countdown <= 1.2 * delay + 0.05, (n, got)
    assert dup.get(timeout=30)["tag"] == "dup"


def test_raise_policy_fails_with_duplicate_error_naming_holder(client_app, events, key):
    task = client_app.tasks["t.hold_raise"]
    first = task.delay(key, 1.5, "first")
    from tests.support import wait_for

    wait_for(lambda: events.starts("first"), 10, what="holder start")
    dup = task.delay(key, 0.0, "dup")
    with pytest.raises(DuplicateTaskError) as info:
        dup.get(timeout=10)
    assert info.value.holder == first.id
    assert info.value.state == "running"
    assert f"is already running under key {info.value.key}" in str(info.value)
    first.get(timeout=10)
    assert [e["tag"] for e in events.starts()] == ["first"]


def test_skip_result_says_whether_the_holder_runs_or_is_done(client_app, events, key):
    """The skip result's ``state``: "running" while the holder runs, "done" within
    the holder's ``singleton_done_ttl`` after it succeeded."""
    hold = client_app.tasks["t.run_done"]
    first = hold.delay(key, 1.5, "first")
    from tests.support import wait_for

    wait_for(lambda: events.starts("first"), 10, what="holder start")
    running = hold.delay(key, 0.0, "dup").get(timeout=10)
    assert running["holder"] == first.id and running["state"] == "running", running
    first.get(timeout=10)
    done = hold.delay(key, 0.0, "late").get(timeout=10)
    assert done["holder"] == first.id and done["reason"] == "done", done
    assert done["state"] == "done", done


def test_storm_of_duplicates_never_overlaps(client_app, events, key):
    """Many deliveries over a few keys across three processes: never two at once per key."""
    hold = client_app.tasks["t.hold"]
    results = [hold.delay(f"{key}-{i % 3}", 0.05, f"s{i}") for i in range(60)]
    for res in results:
        try:
            res.get(timeout=30)
        except CeleryTimeout:  # pragma: no cover - reported by the assert below
            pytest.fail("a delivery never got an answer")
    starts = events.starts()
    assert starts, "nothing ran"
    assert max(e["concurrent"] for e in starts) == 1


@pytest.mark.parametrize("task_name", ["t.hold", "t.limit2"])
def test_a_key_held_on_another_host_is_skipped_never_taken_over(client_app, redis_server, r,
                                                                events, key, task_name):
    """A worker on a second machine holds the key (every slot of it, under
    ``singleton_limit``): its records carry that machine's host key, its host
    name and its worker child's pid, which names no process here. Every
    duplicate reaching this host's worker is skipped naming that holder; none
    runs, and the records are untouched: a pid lookup here says nothing about
    a process there."""
    from celery_singleton_lock import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from tests.support import held_on_another_host

    task = client_app.tasks[task_name]
    keys = task.singleton_keys(key)
    remote = connect(SingletonConfig.defaults(redis_server.url(2)))
    slots = keys.slots(task.singleton_settings().config.limit)
    for n, slot in enumerate(slots, 1):
        granted = remote.acquire(keys, Request(task_id=f"remote-{n}", exec_id=f"remote-exec-{n}",
                                               lease=Lease.of_ms(60_000),
                                               hostname="w1@other-machine", retries=0,
                                               task_name=task_name,
                                               slots=len(slots)))
        assert granted.token > 0 and r.get(slot.lock) is not None
        held_on_another_host(r, slot.lock)
    records = [r.get(slot.lock) for slot in slots]
    dups = [task.delay(key, 0.0, f"dup{i}") for i in range(3)]
    for dup in dups:
        result = dup.get(timeout=15)
        assert is_skipped(result) and result["holder"] == "remote-1", result
    assert events.starts() == [], "a duplicate ran while the other host held the key"
    assert [r.get(slot.lock) for slot in slots] == records
