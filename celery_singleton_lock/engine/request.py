"""What an execution asks the engine for when it starts: one :class:`Request`.

A task's settings are in the seconds its user writes; the engine and Redis
count milliseconds. Each duration is converted once, when a task's settings
are read (:class:`Lease` for ``singleton_ttl``, :func:`to_ms` for the others),
and travels as milliseconds from there to the Redis call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union


def to_ms(seconds: float) -> int:
    """Seconds as whole milliseconds, rounded (1.005 s is 1005 ms, not 1004)."""
    return round(seconds * 1000)


@dataclass(frozen=True)
class Lease:
    """How long a grant or a renewal keeps a lock: ``singleton_ttl``, in the
    seconds a user sets and the milliseconds Redis counts, converted here once."""

    seconds: float
    ms: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ms", to_ms(self.seconds))

    @classmethod
    def of(cls, value: Union[float, Lease]) -> Lease:
        return value if isinstance(value, Lease) else cls(float(value))

    @classmethod
    def of_ms(cls, ms: int) -> Lease:
        return cls(ms / 1000)

    def ms_after(self, delay: float) -> int:
        """The lease counted from ``delay`` seconds from now: a retry's countdown,
        through which the lock is kept for the retried execution."""
        return self.ms + to_ms(max(delay, 0.0))


class Request(NamedTuple):
    """One acquire: who asks (``task_id``, ``exec_id``, and for the owner
    record ``hostname``, ``retries``, ``task_name``) and on what terms.

    ``scope``        ``"run"``, ``"queue"`` or ``"queue_and_run"``
    ``throttle_ms``  > 0: a grant opens a window that long in which no other
                     task id of the key starts (``singleton_throttle``)
    ``slots``        > 1: one of that many slots (``singleton_limit``)
    ``replace``      a task a later send superseded is told so
    ``done``         the task keeps a done window (``singleton_done_ttl``):
                     False, and no done marker is looked for
    ``rate``         (starts, window ms) of ``singleton_rate``; (0, 0): none

    A named tuple: one is made per task, and a tuple is made in a fraction of
    a frozen dataclass's instructions.
    """

    task_id: str
    exec_id: str
    lease: Lease
    hostname: str = ""
    retries: int = 0
    task_name: str = ""
    scope: str = "run"
    throttle_ms: int = 0
    slots: int = 1
    replace: bool = False
    done: bool = True
    rate: tuple[int, int] = (0, 0)

    @property
    def plain(self) -> bool:
        """One slot, scope ``run``, no throttle, rate or replace: what the
        native commands serve."""
        return (self.slots == 1 and self.scope == "run" and not self.throttle_ms
                and not self.replace and not self.rate[0])
