"""What a test asserts about a singleton task: a key made to look held, and the
results a duplicate gets (a skip at run, a refusal at send)."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, Optional


@contextlib.contextmanager
def hold_key(task: Any, *args: Any, holder: str = "", ttl: float = 60.0,
             **kwargs: Any) -> Iterator[str]:
    """Make the call ``task(*args, **kwargs)`` look held by another execution.

    While the block runs, a worker that starts that call treats it as a
    duplicate (its ``singleton_on_duplicate`` policy applies), and a send under
    the ``queue_and_run`` scope is refused. Yields the holder's task id; the key
    is freed at the end (if the fake holder still has it).
    """
    from ..engine.registry import engine_for
    from ..engine.request import Lease, Request
    from ..process import PROCESS

    keys = task.singleton_keys(*args, **kwargs)
    engine = engine_for(task.app)
    holder = holder or f"held-by-test-{uuid.uuid4().hex[:8]}"
    exec_id = PROCESS.new_exec_id()
    answer = engine.acquire(keys, Request(holder, exec_id, Lease(ttl), "test",
                                          task_name=task.name))
    if answer.holder is not None:
        raise AssertionError(f"{keys.base} is already held by {answer.holder.task_id}")
    try:
        yield holder
    finally:
        engine.release(keys, exec_id, holder, finished=False)


def assert_skipped(result: Any, *, holder: Optional[str] = None,
                   reason: Optional[str] = None) -> dict[str, Any]:
    """``result`` (an AsyncResult, or the value it returned) is a skipped
    duplicate's, held by ``holder`` for ``reason`` ("duplicate" or "done")."""
    from ..conflict.results import is_skipped

    value = result.get(timeout=30) if hasattr(result, "get") and hasattr(result, "id") else result
    assert is_skipped(value), f"not a skipped duplicate's result: {value!r}"
    if holder is not None:
        assert value["holder"] == holder, f"held by {value['holder']}, not {holder}"
    if reason is not None:
        assert value["reason"] == reason, f"skipped for {value['reason']!r}, not {reason!r}"
    return dict(value)


def assert_deduplicated(result: Any, *, holder: Optional[str] = None,
                        reason: Optional[str] = None) -> Any:
    """``result`` is what ``delay``/``apply_async`` returned for a send refused at
    send time: nothing was sent, and it stands for ``holder``'s result."""
    from ..conflict.results import is_deduplicated

    assert is_deduplicated(result), f"the send was not refused: {result!r}"
    if holder is not None:
        assert result.holder == holder, f"refused for {result.holder}, not {holder}"
    if reason is not None:
        assert result.reason == reason, f"refused for {result.reason!r}, not {reason!r}"
    return result
