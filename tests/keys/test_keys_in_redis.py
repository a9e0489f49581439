"""Every key the library writes is on the pages that list them, with its TTL:
docs/redis-keys.md's table of every key, and docs/capacity.md's copy of it.

The table is read from each page; its rows are checked against the code's
key names (no server), and against a real lock Redis after a real worker and
a real beat ran a workload that writes each kind of key (``acks_late`` runs,
a done window, a throttle, a rate, two slots of a limit, a replaced send,
beat ticks under four overlap modes, the counters and the held locks): every
key the server holds matches a row, pattern and TTL, and every row marked
*yes* is matched by a key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import re
import time
import uuid
from typing import Iterator, Optional

import pytest

from celery_singleton_lock.beat.ticks import (
    buffer_key,
    claim_key,
    last_sent_key,
    late_key,
    queue_key,
)
from celery_singleton_lock.config import BEAT_SETTINGS, SETTINGS
from celery_singleton_lock.keys import LockKeys
from celery_singleton_lock.observe.monitor import held_key, stats_key
from celery_singleton_lock.worker.ticks import cancel_key, run_key
from tests.keysworkload import CONF, RATE_WINDOW, TASKS, make_workload_app
from tests.support import ROOT, RedisServer, Worker, discard, wait_for

PAGES = ("redis-keys.md", "capacity.md")
MARK = "<!-- every key:"
PREFIX = "singleton:"
#: the workload's countdown for its sends under scope queue
COUNTDOWN = 90.0
#: its beat entries: every second each
SCHEDULE = {
    "kw-skip": {"task": "t.tick_hold", "every": 1, "kwargs": {"key": "kw-skip", "seconds": 0.1}},
    "kw-buffer-one": {"task": "t.tick_hold", "every": 1,
                      "kwargs": {"key": "kw-b1", "seconds": 2.5},
                      "options": {"singleton_overlap": "buffer_one"}},
    "kw-buffer-all": {"task": "t.tick_hold", "every": 1,
                      "kwargs": {"key": "kw-ba", "seconds": 2.5},
                      "options": {"singleton_overlap": "buffer_all"}},
    "kw-cancel": {"task": "t.tick_cancellable", "every": 1,
                  "kwargs": {"key": "kw-c", "seconds": 5.0},
                  "options": {"singleton_overlap": "cancel_other"}},
}
UNITS = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
PLACEHOLDERS = {"<prefix>": re.escape(PREFIX), "<d>": "[0-9a-f]{32}", "<e>": "[0-9a-f]{32}",
                "<r>": "[0-9a-f]{32}", "<md5>": "[0-9a-f]{32}", "<tick>": "[0-9]+",
                "<n>": "[0-9]+"}


@dataclasses.dataclass
class Row:
    """One row of a page's table of every key."""

    page: str
    key: str  # the key cell as written
    patterns: list[re.Pattern[str]]
    formula: str  # the TTL as a sum of terms
    up_to: bool  # the TTL is at most the formula's value, not that value
    default: Optional[float]  # the value in brackets, with the defaults
    produced: bool  # "yes" in the workload column
    persists: bool = False  # the TTL cell says a key of it may have none ("none")

    def seconds(self, values: dict[str, float]) -> float:
        total = 0.0
        for term in self.formula.split(" + "):
            term, _, divisor = term.partition(" / ")
            amount = re.fullmatch(r"([0-9.]+) (ms|s|min|h|d)", term)
            if amount:
                value = float(amount[1]) * UNITS[amount[2]]
            elif term in values:
                value = values[term]
            else:
                raise AssertionError(f"{self.page}: the TTL of {self.key} names {term!r}, "
                                     "which has no value here")
            total += value / float(divisor or 1)
        return total


def key_pattern(text: str) -> re.Pattern[str]:
    out = re.escape(text)
    for holder, regex in PLACEHOLDERS.items():
        out = out.replace(re.escape(holder), regex)
    return re.compile(re.sub(r"<[^>]+>", ".+", out.replace(r"\<", "<").replace(r"\>", ">")))


def rows_of(page: str) -> list[Row]:
    text = (ROOT / "docs" / page).read_text()
    assert text.count(MARK) == 1, f"{page}: one table of every key, marked {MARK!r}"
    lines = text[text.index(MARK):].splitlines()[1:]  # the header, its rule, the rows
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        key, ttl, workload = (cell.strip() for cell in line.strip("|").split(" | "))
        patterns: list[str] = []
        for name in re.findall(r"`([^`]+)`", key):
            if name.startswith(":"):  # a suffix of the last key's base
                name = patterns[-1].rsplit(":", 1)[0] + name
            patterns.append(name)
        head = ttl.split(";")[0].strip()
        up_to = head.startswith("up to ")
        head = head.removeprefix("up to ")
        bracket = re.search(r" \(([^)]*)\)$", head)
        default = None
        if bracket:
            head = head[:bracket.start()]
            amount = re.fullmatch(r"([0-9.]+) (ms|s|min|h|d)", bracket[1])
            assert amount, f"{page}: {key}: a default in brackets is an amount: {bracket[1]}"
            default = float(amount[1]) * UNITS[amount[2]]
        assert workload.startswith(("yes", "no")), f"{page}: {key}: {workload}"
        rows.append(Row(page, key, [key_pattern(p) for p in patterns], head, up_to, default,
                        workload.startswith("yes"), re.search(r"\bnone\b", ttl) is not None))
    assert rows, f"{page}: no rows under {MARK!r}"
    return rows


def setting_defaults() -> dict[str, float]:
    """Each numeric setting's default in seconds (``singleton_wait_timeout`` is ms)."""
    values = {f"`{s.name}`": float(s.default) for s in SETTINGS
              if isinstance(s.default, (int, float)) and not isinstance(s.default, bool)}
    values["`singleton_wait_timeout`"] /= 1000
    values.update({f"`{name}`": float(default) for name, default, _ in BEAT_SETTINGS
                   if isinstance(default, (int, float))})
    return values


def workload_values() -> dict[str, float]:
    """What each TTL's terms are in the workload of the test below."""
    values = setting_defaults()
    values.update({f"`{name}`": float(value) for name, value in CONF.items()})
    for options in TASKS.values():
        values.update({f"`{name}`": float(value) for name, value in options.items()
                       if name.startswith("singleton_") and isinstance(value, (int, float))})
    values.update({"countdown": COUNTDOWN, "`singleton_rate`'s window": RATE_WINDOW,
                   "the entry's period": 1.0})
    return values


def test_every_key_the_code_names_is_on_both_pages_with_its_default_ttl():
    """Every row reads (its key patterns, its TTL as a sum of settings and
    amounts, the value with the defaults in brackets, which the settings'
    defaults give); both pages list the same keys and TTLs; and every key name
    the code builds (a lock's keys, a slot's, beat's, the counters' and the
    held locks') matches exactly one row."""
    pages = {page: rows_of(page) for page in PAGES}
    defaults = setting_defaults()
    for rows in pages.values():
        for row in rows:
            if row.default is not None:
                assert row.seconds(defaults) == pytest.approx(row.default), (row.page, row.key)
    first, *others = pages.values()
    for rows in others:
        assert [(r.key, r.formula, r.up_to, r.default, r.produced, r.persists)
                for r in rows] == [
            (r.key, r.formula, r.up_to, r.default, r.produced, r.persists) for r in first]
    keys = LockKeys(PREFIX, "0123456789abcdef" * 2)
    tick = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.timezone.utc)
    named = [keys.lock, keys.slot(2).lock, keys.fence, keys.fin, keys.done, keys.queued,
             keys.throttle, keys.rate, keys.replaced, keys.back, keys.waiting("e1f"),
             cancel_key(keys), claim_key(PREFIX, "report", tick), run_key(PREFIX, "report", tick),
             buffer_key(PREFIX, "report"), queue_key(PREFIX, "report"),
             last_sent_key(PREFIX, "report"), late_key(PREFIX, "report"), stats_key(PREFIX),
             held_key(PREFIX)]
    for name in named:
        matches = [r.key for r in first if any(p.fullmatch(name) for p in r.patterns)
                   and "<r>" not in r.key]
        assert len(matches) == 1, (name, matches)


def fits(row: Row, ttl_ms: int, values: dict[str, float], elapsed: float) -> bool:
    """A key with ``ttl_ms`` left, written at most ``elapsed`` seconds ago, has
    the TTL ``row`` gives (at most it, when the row says "up to"). A key with
    no TTL (``PTTL`` -1) fits only a row that says its keys may have none,
    however long ago it was written: the lower bound below goes under -1 once
    ``elapsed`` passes the row's TTL."""
    if ttl_ms < 0:
        return row.persists
    most = row.seconds(values) * 1000
    least = 0.0 if row.up_to else most - (elapsed + 1) * 1000
    return least <= ttl_ms <= most


def test_a_key_without_a_ttl_fits_no_row_under_the_prefix() -> None:
    """``PTTL`` -1 (a key that lives for ever) fits no row of a key under the
    prefix, whose TTLs the pages promise, whether the workload below has run
    for a second or for its whole two minutes; only the old libraries' keys
    (``singleton_also_lock``), whose row says they may have none, take it."""
    values = workload_values()
    for page in PAGES:
        rows = rows_of(page)
        assert [r.key for r in rows if r.persists] == [
            r.key for r in rows if r.key.startswith("`SINGLETONLOCK_")], page
        for row in rows:
            for elapsed in (0.5, 10.0, 120.0):
                assert fits(row, -1, values, elapsed) is row.persists, (page, row.key, elapsed)


@pytest.fixture
def lock_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.mark.worker
@pytest.mark.timeout(240)
def test_every_key_a_real_workload_leaves_is_on_the_pages_and_every_row_is_seen(
        lock_redis: RedisServer) -> None:
    """A worker and a beat run the workload on a Redis of the test's own; its
    lock database is scanned (``SCAN``, ``PTTL``) until every row marked *yes*
    was matched: each key found fits some row of each page, pattern and TTL,
    and none lives for ever."""
    from tests.beat.test_beat import Beat

    pages = {page: rows_of(page) for page in PAGES}
    values = workload_values()
    queue = f"kw-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()  # before anything of the workload wrote a key
    worker = Worker(lock_redis.url(), queue, concurrency=6)
    worker.cmd[worker.cmd.index("tests.workerapp:app")] = "tests.keysworkload:app"
    worker.start()
    beat = Beat(lock_redis.url(), queue, SCHEDULE, name="kw", app="tests.keysworkload:app",
                scheduler="celery_singleton_lock.beat:SingletonScheduler")
    app = make_workload_app(lock_redis.url(), queue)
    locks = lock_redis.client(2)
    seen: dict[str, set[str]] = {page: set() for page in PAGES}
    odd: list[str] = []

    def scan() -> bool:
        elapsed = time.monotonic() - began
        for name in locks.scan_iter(count=500):
            ttl = locks.pttl(name)
            if ttl == -2:
                continue  # expired since the scan named it
            for page, rows in pages.items():
                fit = [r.key for r in rows
                       if any(p.fullmatch(name) for p in r.patterns)
                       and fits(r, ttl, values, elapsed)]
                if not fit:
                    odd.append(f"{page}: {name} (TTL {ttl} ms) fits no row")
                seen[page].update(fit)
        return bool(odd) or all(unseen(page) == [] for page in pages)

    def unseen(page: str) -> list[str]:
        return sorted({r.key for r in pages[page] if r.produced} - seen[page])

    try:
        beat.start()
        for name in ("kw.late", "kw.done", "kw.throttle", "kw.rate"):
            app.tasks[name].delay(f"{name}-1").get(timeout=60)
        for _ in range(2):
            app.tasks["kw.limit"].delay("kw-limit", 60.0)
        for _ in range(2):
            app.tasks["kw.replace"].apply_async(("kw-replace",), countdown=COUNTDOWN)
        with contextlib.suppress(AssertionError):  # said below, with what was seen
            wait_for(scan, 120, what="a key of every row marked yes", interval=0.5)
    finally:
        beat.stop()
        recorder = lock_redis.client(3)
        for key in ("kw-limit", "kw-b1", "kw-ba", "kw-c", "kw-skip"):
            recorder.set(f"finish:{key}", 1)
        discard(worker)
    assert not odd, "\n".join(odd)
    assert {page: unseen(page) for page in pages} == {page: [] for page in pages}, (
        f"rows marked yes that no key matched; the beat's log:\n{beat.logs()[-3000:]}")
