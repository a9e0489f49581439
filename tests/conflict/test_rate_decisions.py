"""What a call over its key's singleton_rate gets, by the duplicate policy (no servers)."""

from __future__ import annotations

import pytest

from celery_singleton_lock.conflict.policies import Do, at_run
from celery_singleton_lock.engine.replies import Acquire, acquired
from celery_singleton_lock.exceptions import DuplicateTaskError

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def over_the_limit() -> object:
    # acquire.lua's answer: the oldest start in the full window, and when it leaves
    return acquired([7, "oldest-id", 1250])


@pytest.mark.parametrize(("policy", "do"), [("skip", Do.SKIP), ("replace", Do.SKIP),
                                            ("retry", Do.WAIT), ("raise", Do.FAIL)])
def test_the_duplicate_policy_decides_and_the_wait_is_until_the_window_reopens(policy, do):
    answer = over_the_limit()
    assert answer.status is Acquire.RATE_LIMITED and answer.holder_state == "started"
    decision = at_run(answer, on_duplicate=policy, task_name="t", key="k")
    assert decision.do is do
    assert decision.reason == "rate limited" and decision.holder == "oldest-id"
    assert decision.reopens_in == 1.25  # a wait is sent again for then, never sooner
    if do is Do.FAIL:
        assert isinstance(decision.error, DuplicateTaskError)
