"""What the ``celery singleton`` commands show: the things held under each
key, read from Redis as rows (a running lock, a send-time marker, a done or
throttle window, the record of replaced calls), merged across Redlock
masters, and laid out as a table.

Only key hashes are ever shown, never argument values.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence

import click
import redis

from ..engine.replies import record as owner_record


@dataclass
class Row:
    """One thing held under a key: a running lock, a send-time marker, a done or
    throttle window, or the record of the calls a later send replaced."""

    key: str
    state: str
    task: str
    holder: str
    host: str = ""
    pid: int = 0
    #: the fencing token of a running lock; None for a marker or a window
    token: Optional[int] = None
    ttl: Optional[float] = None
    age: Optional[float] = None
    live: str = ""
    exec: str = ""
    #: Redlock: on how many masters, of how many (``(3, 5)``); None on one server
    masters: Optional[tuple[int, int]] = None
    #: a running lock's slot (``singleton_limit``): 1, or 2 to N; None for the others
    slot: Optional[int] = None
    #: ``replaced``: how many calls later sends superseded; None for the others
    superseded: Optional[int] = None

    def cells(self) -> list[str]:
        live = self.live if self.superseded is None else f"{self.superseded} superseded"
        cells = [self.key, self.state, self.task or "?", self.holder, self.host,
                 str(self.pid or ""), "" if self.token is None else str(self.token),
                 seconds(self.ttl), seconds(self.age), live]
        return [*cells, "/".join(map(str, self.masters))] if self.masters else cells

    def held(self) -> bool:
        """Held as the lock sees it: always on one server; on a majority with Redlock."""
        if self.masters is None:
            return True
        on, total = self.masters
        return on * 2 > total


def token_of(record: dict[str, str]) -> Optional[int]:
    """An owner record's fencing token (digits), or None when it has none."""
    token = record.get("token", "")
    return int(token) if token.isdigit() else None


HEADERS = ["KEY", "STATE", "TASK", "HOLDER", "HOST", "PID", "TOKEN", "TTL", "AGE", "LIVE"]


def headers_of(rows: Sequence[Row]) -> list[str]:
    return [*HEADERS, "MASTERS"] if rows and rows[0].masters else HEADERS


def seconds(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.1f}s"


def liveness(record: dict[str, str]) -> str:
    """dead: its process is gone from this host; alive: it runs here; unknown:
    another host (treated as alive: nothing here can tell)."""
    from ..process import Holder

    holder = Holder(task_id=record.get("task", ""), exec_id=record.get("exec", ""),
                    host_key=record.get("hostkey", ""), pid=int(record.get("pid") or 0),
                    hostname=record.get("host", ""))
    if holder.provably_dead():
        return "dead"
    return "alive" if holder.on_this_host else "unknown"


def key_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(
        rf"^{re.escape(prefix)}\{{([0-9a-f]{{32}})\}}:(?:lock(:[0-9]+)?|queued|done|throttle|replaced)$")


def scan_digests(client: redis.Redis, prefix: str) -> list[str]:
    """Every key hash with a lock, marker, window or replaced calls: SCAN, never
    KEYS. Slot ``n`` > 1 of a key (``singleton_limit``) comes as ``<hash>:<n>``."""
    glob = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "{*}:*"
    pattern = key_pattern(prefix)
    found: dict[str, None] = {}
    for name in client.scan_iter(match=glob, count=1000):
        match = pattern.match(str(name))
        if match:
            found.setdefault(match.group(1) + (match.group(2) or ""), None)
    return list(found)


def read_rows(client: redis.Redis, prefix: str, digests: Sequence[str]) -> list[Row]:
    from ..engine.calls import marker_task
    from ..keys import LockKeys

    seconds, micros = client.execute_command("TIME")  # type: ignore[no-untyped-call]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    rows: list[Row] = []
    slots = [d for d in digests if ":" in d]
    if slots:
        rows += read_slots(client, prefix, slots, now_ms)
        digests = [d for d in digests if ":" not in d]
    for start in range(0, len(digests), 500):
        chunk = [LockKeys(prefix, d) for d in digests[start:start + 500]]
        pipe = client.pipeline(transaction=False)
        for keys in chunk:
            pipe.get(keys.lock)
            pipe.pttl(keys.lock)
            pipe.get(keys.queued)
            pipe.pttl(keys.queued)
            pipe.get(keys.done)
            pipe.pttl(keys.done)
            pipe.get(keys.throttle)
            pipe.pttl(keys.throttle)
            pipe.hgetall(keys.replaced)
            pipe.pttl(keys.replaced)
        replies = pipe.execute()
        for i, keys in enumerate(chunk):
            (raw, lock_ttl, queued, queued_ttl, done, done_ttl, throttle,
             throttle_ttl, replaced, replaced_ttl) = replies[10 * i:10 * i + 10]
            record = owner_record(raw)
            name = record.get("name", "") if record else ""
            if record:
                rows.append(run_row(keys.base, record, lock_ttl, now_ms, 1))
            if queued:
                marked, by = marker_task(queued)
                rows.append(Row(key=keys.base, state="queued", task=marked or name, holder=by,
                                ttl=ttl_of(queued_ttl)))
            if done:
                marked, by = marker_task(done)
                rows.append(Row(key=keys.base, state="done", task=marked or name, holder=by,
                                ttl=ttl_of(done_ttl)))
            if throttle:
                marked, _, by = str(throttle).split("\n", 2) if str(throttle).count(
                    "\n") >= 2 else ("", "", str(throttle))
                rows.append(Row(key=keys.base, state="throttled", task=marked or name,
                                holder=by, ttl=ttl_of(throttle_ttl)))
            row = replaced_row(keys.base, replaced, replaced_ttl)
            if row:
                rows.append(row)
    return rows


def replaced_row(base: str, record: Any, pttl: Any) -> Optional[Row]:
    """The row of a key's replaced calls (``singleton_on_duplicate="replace"``):
    the task, the call that runs in their place (the newest send: the one no
    later send replaced) and how many were superseded."""
    from ..engine.calls import marker_task

    entries = {str(k): marker_task(v) for k, v in (record or {}).items() if str(k)}
    if not entries:
        return None
    successors = [by for _, by in entries.values()]
    newest = [by for by in successors if by not in entries] or successors
    name = next((n for n, _ in entries.values() if n), "")
    return Row(key=base, state="replaced", task=name, holder=newest[-1], ttl=ttl_of(pttl),
               superseded=len(entries))


def run_row(base: str, record: dict[str, str], pttl: Any, now_ms: int, slot: int) -> Row:
    """The row of a running lock (slot ``slot``) from its owner record."""
    at = int(record.get("at") or 0)
    return Row(key=base, state="run", task=record.get("name", ""),
               holder=record.get("task", ""), host=record.get("host", ""),
               pid=int(record.get("pid") or 0), token=token_of(record), ttl=ttl_of(pttl),
               age=(now_ms - at) / 1000 if at else None, live=liveness(record),
               exec=record.get("exec", ""), slot=slot)


def read_slots(client: redis.Redis, prefix: str, names: Sequence[str], now_ms: int
               ) -> list[Row]:
    """The running locks of slots ``<hash>:<n>`` (``singleton_limit`` > 1)."""
    from ..keys import LockKeys

    wanted = []
    pipe = client.pipeline(transaction=False)
    for name in names:
        digest, _, text = name.partition(":")
        keys = LockKeys(prefix, digest).slot(int(text))
        wanted.append((keys, int(text)))
        pipe.get(keys.lock)
        pipe.pttl(keys.lock)
    replies = pipe.execute()
    rows = []
    for i, (keys, slot) in enumerate(wanted):
        record = owner_record(replies[2 * i])
        if record:
            rows.append(run_row(keys.base, record, replies[2 * i + 1], now_ms, slot))
    return rows


def merge_views(views: Sequence[list[Row]], total: int) -> list[Row]:
    """Redlock: one row per thing held, with on how many masters it is. A row
    on fewer than a majority is not the lock's view (a grant being given back,
    a master that missed a release): it shows, with its count, to be purged."""
    groups: dict[tuple[str, str, str, str], list[Row]] = {}
    for rows in views:
        for row in rows:
            groups.setdefault((row.key, row.state, row.holder, row.exec), []).append(row)
    merged = []
    for same in groups.values():
        ttls = [r.ttl for r in same if r.ttl is not None]
        tokens = [r.token for r in same if r.token is not None]
        merged.append(replace(
            same[0], ttl=min(ttls) if ttls else None,
            token=max(tokens) if tokens else None, masters=(len(same), total)))
    return merged


def ttl_of(pttl: Any) -> Optional[float]:
    return int(pttl) / 1000 if isinstance(pttl, int) and pttl >= 0 else None


def filtered(rows: Iterable[Row], task: Optional[str], state: Optional[str]) -> list[Row]:
    return [r for r in rows if (task is None or r.task == task)
            and (state is None or r.state == state)]


def table(headers: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def echo_json(data: Any) -> None:
    """``--json``: one document, keys sorted, for scripts."""
    click.echo(json.dumps(data, indent=2, sort_keys=True))
