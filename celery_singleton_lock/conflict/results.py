"""What a caller gets back from a duplicate: the skip result of a run-time
duplicate, and the :class:`DeduplicatedResult` of a send refused at send time."""

from __future__ import annotations

from typing import Any, Optional

from celery.result import AsyncResult


def skip_result(key: str, holder: Optional[str], reason: str = "duplicate",
                state: str = "running", reopens_in: Optional[float] = None
                ) -> dict[str, Any]:
    """The result a skipped duplicate returns (plain JSON); ``state`` is what the
    holder was doing: ``"queued"``, ``"running"`` or ``"done"`` (``"started"``:
    it started within the throttle window, which reopens in ``reopens_in`` s)."""
    result: dict[str, Any] = {"skipped": True, "holder": holder, "key": key, "reason": reason,
                              "state": state}
    if reopens_in is not None:
        result["reopens_in"] = round(reopens_in, 3)
    return result


def is_skipped(result: Any) -> bool:
    """True when ``result`` is what a skipped duplicate returned."""
    return isinstance(result, dict) and result.get("skipped") is True and "holder" in result


class DeduplicatedResult(AsyncResult):  # type: ignore[misc]
    """The result of the task that holds the key, returned instead of sending.

    Its ``id`` is the holder's task id, so ``.get()`` waits for and returns the
    holder's result. ``deduplicated`` is True; ``holder`` is that task id,
    ``refused_id`` the id the refused send would have had, ``key`` the lock key
    and ``reason`` either ``"duplicate"`` (queued or running) or ``"done"``
    (succeeded within ``singleton_done_ttl``).
    """

    deduplicated = True

    def __init__(self, holder: str, *, key: str, reason: str, refused_id: str,
                 task: Any) -> None:
        super().__init__(holder, backend=task.backend, task_name=task.name, app=task.app)
        self.holder = holder
        self.key = key
        self.reason = reason
        self.refused_id = refused_id

    def __repr__(self) -> str:
        return f"<DeduplicatedResult: {self.id} ({self.reason}, refused {self.refused_id})>"


def is_deduplicated(result: Any) -> bool:
    """True when ``apply_async``/``delay`` sent nothing because the key was taken."""
    return getattr(result, "deduplicated", False) is True
