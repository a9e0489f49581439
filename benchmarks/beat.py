"""Beat claim cost: 1,000 interval entries x 3 beats at a 1 s period, against a real Redis.

    python -m benchmarks.beat

Three ``SingletonSchedulerMixin`` schedulers in one process walk the same
virtual seconds; the send itself is recorded instead of published (the broker
cost is Celery's, the same with or without claims). Reports Redis round trips
per tick (from the server's own command counters), beat CPU per tick and per
second of schedule, and checks every tick was sent exactly once. Results go to
``benchmarks/results/beat.md``.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import Scheduler

from celery_singleton_lock.beat import SingletonSchedulerMixin

from .servers import Redis

ENTRIES = 1000
BEATS = 3
SECONDS = 10
RESULTS = Path(__file__).resolve().parent / "results" / "beat.md"


class BenchScheduler(SingletonSchedulerMixin, Scheduler):  # type: ignore[misc]
    clock: dt.datetime
    sent: Counter[tuple[str, dt.datetime]]

    def singleton_now(self) -> dt.datetime:
        return self.clock

    def _send(self, entry: Any, tick: dt.datetime, producer: Any) -> None:
        self.sent[(entry.name, tick)] += 1


def main() -> None:
    server = Redis().start()
    try:
        app = Celery("bench-beat", broker=server.url(0), set_as_current=False)
        app.conf.singleton_redis_url = server.url(2)
        app.conf.beat_schedule = {f"e{i}": {"task": "t.noop", "schedule": 1.0}
                                  for i in range(ENTRIES)}
        beats = [BenchScheduler(app=app) for _ in range(BEATS)]
        for beat in beats:
            beat.sent = Counter()
        start = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(days=1)
        client = server.client(2)
        client.config_resetstat()
        cpu = [0.0] * BEATS
        for second in range(SECONDS):
            for i, beat in enumerate(beats):
                beat.clock = start + dt.timedelta(seconds=second, milliseconds=5 * i)
                t0 = time.process_time()
                for entry in list(beat.schedule.values()):
                    if beat.is_due(entry)[0]:
                        beat.apply_entry(entry)
                cpu[i] += time.process_time() - t0
        stats = client.info("commandstats")
        calls = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_config")
        sent = Counter[tuple[str, dt.datetime]]()
        for beat in beats:
            sent.update(beat.sent)
        ticks = ENTRIES * SECONDS
        assert len(sent) == ticks and set(sent.values()) == {1}, "a tick sent twice or missing"
        attempts = ticks * BEATS
        lines = [
            "# Beat: per-tick claims",
            "",
            f"{ENTRIES} interval entries x {BEATS} beats, 1 s period, {SECONDS} s of schedule; "
            "sends recorded, not published.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| ticks, each sent exactly once | {len(sent)} |",
            f"| Redis commands per beat per tick (claim attempts) | {calls / attempts:.2f} |",
            f"| Redis round trips per tick, all beats | {calls / ticks:.2f} |",
            f"| beat CPU per tick per beat | {sum(cpu) / attempts * 1e6:.0f} µs |",
            f"| beat CPU per second of schedule, one beat | "
            f"{sum(cpu) / BEATS / SECONDS * 1000:.0f} ms |",
            "",
        ]
        RESULTS.write_text("\n".join(lines))
        print("\n".join(lines))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
