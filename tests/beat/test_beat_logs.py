"""What each of several real `celery beat` processes says in its own log: that
ticks are shared through Redis, and every tick of an entry, the ones it sent
and the ones another beat claimed, so a 1 s entry reads as a 1 s entry in
every log."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest

from celery_singleton_lock.beat.ticks import queue_key
from celery_singleton_lock.worker.ticks import from_ms, tick_name
from tests.beat.test_beat import (  # noqa: F401
    Beat,
    beat_worker,
    beats,
    clean_stats,
    parse,
    tick_events,
)
from tests.beatapp import make_beat_app
from tests.support import wait_for

pytestmark = pytest.mark.worker


def test_each_beats_log_says_ticks_are_shared_and_names_the_ticks_another_beat_claimed(
        redis_server, beat_worker, beats, events, clean_stats):  # noqa: F811
    """Two beats, clocks 0.35 s apart, a 1 s entry: each beat logs at start that
    it shares its ticks through the lock Redis, naming its own id; every tick
    the other beat sent while this one ran is in this one's log at INFO, named,
    with the id of the beat that claimed it."""
    sched = {"every-second": {"task": "t.tick", "every": 1}}
    for name, offset in (("a", 0.0), ("b", 0.35)):
        beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name=name,
                          offset=offset).start())

    def sent_by() -> dict[str, str]:
        return {e["singleton_beat_tick"]: e["singleton_beat_id"]
                for e in tick_events(events, "every-second")}

    wait_for(lambda: len(sent_by()) >= 8, 40, what="8 ticks from two beats")
    for beat in beats:
        beat.stop()
    ticks = sent_by()
    started = re.compile(
        r"INFO/MainProcess\] celery-singleton-lock: beat (\S+) shares its ticks with every "
        r"other beat of this app through redis://127\.0\.0\.1:\d+/2: each tick is sent by "
        r"the beat that claims it first; a tick another beat claimed is logged as such")
    other = re.compile(r"INFO/MainProcess\] Beat entry 'every-second' tick (\S+) claimed by "
                       r"another beat \((\S+)\), which sends it")
    missed = re.compile(r"Beat entry 'every-second': (\d+) tick\(s\) before (\S+) missed")
    ids = []
    for beat in beats:
        log = beat.logs()
        [beat_id] = started.findall(log)
        ids.append(beat_id)
        logged = dict(other.findall(log))
        mine = {t for t, by in ticks.items() if by == beat_id}
        assert all(ticks.get(t) == by and by != beat_id for t, by in logged.items()), logged
        span = sorted(mine | set(logged))
        assert span, f"beat {beat.name} decided no tick"
        # a beat woken late decides only the latest tick it slept through, and
        # says so ("N tick(s) before T missed"): those it never claimed
        slept = {tick_name(parse(t) - dt.timedelta(seconds=k))
                 for n, t in missed.findall(log) for k in range(1, int(n) + 1)}
        theirs = {t for t, by in ticks.items() if by != beat_id and span[0] <= t <= span[-1]}
        assert theirs - slept <= set(logged), (beat.name, sorted(theirs - set(logged)))
    assert set(ticks.values()) <= set(ids)
    assert any(other.search(b.logs()) for b in beats), "one beat sent every tick: nothing shown"


def test_a_buffer_all_backlog_is_capped_outlives_every_beat_and_drains_oldest_first(
        redis_server, beat_worker, beats, events, r, clean_stats):  # noqa: F811
    """docs/beat.md, buffer_all with runs longer than the interval: the waiting
    ticks grow to singleton_beat_buffer_max and stay there (newer ticks are
    dropped); when every beat stops, the backlog stays in Redis for an hour
    after its last tick was added, nothing taking from it; a beat started
    again sends it, oldest first, one run at a time."""
    key = uuid.uuid4().hex[:8]
    sched = {"backlog": {"task": "t.tick_hold", "every": 1,
                         "kwargs": {"key": key, "seconds": 1.5},
                         "options": {"singleton_overlap": "buffer_all"}}}
    conf = {"singleton_beat_buffer_max": 3}
    queue = queue_key("singleton:", "backlog")
    beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name="first",
                      conf=conf).start())
    sizes: list[int] = []

    def dropped() -> bool:
        sizes.append(r.zcard(queue))
        return "dropped: 3 ticks already wait" in beats[0].logs()

    wait_for(dropped, 30, what="the backlog full and a tick dropped")
    beats[0].kill()
    waiting = sorted(int(m) for m in r.zrange(queue, 0, -1))
    # never more than the cap; at the kill 3, or 2 when a run had just taken
    # the oldest (one is taken every 1.5 s, one added every 1 s)
    assert max(sizes) <= 3 and 2 <= len(waiting) <= 3, (sizes, waiting)
    assert 3_500_000 < r.pttl(queue) <= 3_600_000, "an hour after its last tick was added"
    wait_for(lambda: len(tick_events(events, "backlog", "end")) == len(
        tick_events(events, "backlog", "start")), 10, what="the running tick to end")
    # its lock freed: the worker is done with it (the beat, killed, waited for)
    lock = make_beat_app(redis_server.url(), "unused").tasks["t.tick_hold"].singleton_keys(
        key=key).lock
    wait_for(lambda: not r.exists(lock), 10, what="the running tick's lock to be freed")
    # every beat down: nothing took from the backlog when the run ended
    assert sorted(int(m) for m in r.zrange(queue, 0, -1)) == waiting
    beats.append(Beat(redis_server.url(), beat_worker.queue, sched, name="second",
                      conf=conf).start())

    def started_after_restart() -> list[str]:
        return [e["singleton_beat_tick"] for e in tick_events(events, "backlog", "start")
                if e["singleton_beat_id"].split(":")[1] == str(beats[1].proc.pid)]

    n = len(waiting)
    ran = wait_for(lambda: started_after_restart()[:n] if len(
        started_after_restart()) >= n else None, 30, what="the backlog's runs after the restart")
    assert ran == [tick_name(from_ms(ms)) for ms in waiting], (ran, waiting)
