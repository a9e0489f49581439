"""What an operator sees, with real Flower (from PyPI) and a real worker started
with ``-E``: skipped duplicates as SKIPPED with holder and reason, waits with
whom they wait for, refused sends as REFUSED, held locks per worker in
``celery inspect stats`` / ``/api/workers`` / ``celery inspect singleton_locks``,
the lock metrics on Flower's ``/metrics``; and canvases with a skipped member
still complete."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytest
from celery import chain, chord

from celery_singleton_lock import is_deduplicated, is_skipped
from tests.support import (
    ROOT,
    RedisServer,
    Worker,
    discard,
    missing,
    serve_on_free_port,
    wait_for,
)
from tests.workerapp import make_app

pytestmark = pytest.mark.worker

FLOWER_CONF = """\
from celery_singleton_lock.observe.metrics import register
from celery_singleton_lock.observe.monitor import flower_format_task
register({url!r})
format_task = flower_format_task({url!r})
"""
COLUMNS = "name,uuid,state,result,received,runtime,worker"


class Flower:
    """`celery -A tests.workerapp:app flower` as a subprocess, its API open."""

    def __init__(self, worker: Worker) -> None:
        self.dir = tempfile.mkdtemp(prefix="singleton-flower-")
        lock_url = json.loads(worker.env["SLT_CONF"]).get("singleton_redis_url") or (
            worker.env["SLT_REDIS_URL"].rsplit("/", 1)[0] + "/2")
        conf = Path(self.dir) / "flowerconfig.py"
        conf.write_text(FLOWER_CONF.format(url=lock_url))
        self.log = Path(self.dir) / "flower.log"
        env = dict(worker.env, FLOWER_UNAUTHENTICATED_API="true")

        def spawn(port: int) -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "flower",
                 f"--port={port}", "--address=127.0.0.1", f"--conf={conf}",
                 f"--tasks_columns={COLUMNS}"],
                env=env, cwd=str(ROOT), stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                start_new_session=True)

        self.proc, self.port = serve_on_free_port(
            spawn, lambda: self.log.read_text(errors="replace"),
            lambda port: _answers(f"http://127.0.0.1:{port}/healthcheck"), what="Flower")
        self.base = f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=15) as resp:
            body = resp.read().decode()
        return json.loads(body) if path.startswith("/api/") else body

    def try_get(self, path: str) -> Any:
        try:
            return self.get(path)
        except OSError:
            return None

    def task(self, task_id: str) -> dict[str, Any]:
        return dict(self.try_get(f"/api/task/info/{task_id}") or {})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def setup(redis_server: RedisServer) -> Iterator[tuple[Worker, Flower, Any, str]]:
    queue = f"fl-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, concurrency=4, extra_args=["-E"]).start()
    flower = Flower(worker)
    hostname = worker.name.replace("%h", socket.gethostname())
    app = make_app(redis_server.url(), queue, conf={"task_send_sent_event": True})
    try:
        wait_for(lambda: hostname in (flower.try_get("/api/workers?refresh=1") or {}), 30,
                 what="Flower sees the worker")
        # Flower receives task events: a first task shows up in its list
        warm = app.tasks["t.plain"].delay("warm")
        warm.get(timeout=10)
        wait_for(lambda: flower.task(warm.id).get("state") == "SUCCESS", 15,
                 what="Flower receives task events")
        yield worker, flower, app, hostname
    finally:
        flower.stop()
        discard(worker)


def started(events: Any, tag: str) -> bool:
    return bool(events.starts(tag))


def test_skipped_duplicate_is_skipped_in_flower_with_holder_and_reason_and_get_returns_at_once(
        setup, events, key):
    """The duplicate's .get() returns the skip result while the holder still runs,
    Flower lists it under state=SKIPPED with holder and reason in its result, and
    the holder finishing later does not turn it into SUCCESS."""
    _worker, flower, app, hostname = setup
    t = app.tasks["t.hold"]
    holder = t.delay(key, 3.0, "holder")
    wait_for(lambda: started(events, "holder"), 10, what="holder start")
    dup = t.delay(key, 0.0, "dup")
    value = dup.get(timeout=10)
    assert is_skipped(value) and value["holder"] == holder.id and value["reason"] == "duplicate"
    assert not holder.ready(), "the skip answered only after the holder ended"
    assert dup.state == "SUCCESS"

    def listed() -> Any:
        rows = flower.try_get("/api/tasks?state=SKIPPED") or {}
        return rows.get(dup.id)

    row = wait_for(listed, 15, what="the duplicate in /api/tasks?state=SKIPPED")
    assert row["state"] == "SKIPPED" and row["name"] == "t.hold"
    assert row["result"] == f"duplicate of {holder.id} ({value['key']})"
    assert row["worker"] == hostname
    holder.get(timeout=10)
    wait_for(lambda: flower.task(holder.id).get("state") == "SUCCESS", 10, what="holder done")
    assert flower.task(dup.id)["state"] == "SKIPPED"


def test_throttled_and_replaced_skips_show_in_flower_and_the_metrics_by_reason(
        setup, events, key):
    """A call inside a throttle window and a call a later send replaced are
    SKIPPED in Flower, each result naming its reason and the call it yields
    to, and counted in /metrics under reason="throttled" and "replaced"."""
    _worker, flower, app, hostname = setup
    labels = f'hostname="{hostname}"'
    throttled = f'celery_singleton_skips_total{{{labels},name="t.throttle",reason="throttled"}}'
    replaced = (f'celery_singleton_skips_total{{{labels},name="t.queue_replace",'
                f'reason="replaced"}}')
    before = scrape(flower)

    opener = app.tasks["t.throttle"].delay(key, 0.0, "opener")
    opener.get(timeout=10)
    inside = app.tasks["t.throttle"].delay(key, 0.0, "inside")
    value = inside.get(timeout=10)
    assert is_skipped(value) and value["reason"] == "throttled", value

    t = app.tasks["t.queue_replace"]
    first = t.apply_async((f"{key}-r", 0.0, "first"), countdown=1)
    second = t.apply_async((f"{key}-r", 0.0, "second"), countdown=1)
    assert first.get(timeout=5)["holder"] == second.id
    assert second.get(timeout=15)["tag"] == "second"

    def skipped(task_id: str) -> Any:
        rows = flower.try_get("/api/tasks?state=SKIPPED") or {}
        return rows.get(task_id)

    row = wait_for(lambda: skipped(inside.id), 15, what="the throttled call in Flower")
    assert row["result"] == f"throttled by {opener.id} ({value['key']})"
    row = wait_for(lambda: skipped(first.id), 15, what="the replaced call in Flower")
    assert row["result"].startswith(f"replaced by {second.id} (")

    def counted() -> Any:
        now = scrape(flower)
        return now if (now.get(throttled, 0) > before.get(throttled, 0)
                       and now.get(replaced, 0) > before.get(replaced, 0)) else None

    after = wait_for(counted, 15, what="both reasons counted in /metrics")
    assert after[throttled] - before.get(throttled, 0) == 1
    assert after[replaced] - before.get(replaced, 0) == 1


def test_a_skip_is_skipped_in_flower_when_flower_turned_the_workers_events_on(
        own_redis, key):
    """A worker started as the README starts it, without -E: Flower switches
    its task events on (enable_events) after the pool forked. A duplicate
    skipped then is SKIPPED in Flower, with its holder, and never SUCCESS,
    while its caller's .get() returns the skip result at once. (A broker of
    its own: the module's Flower would see these events too.)"""
    from tests.conftest import Events

    events = Events(own_redis)
    queue = f"fl-noE-{uuid.uuid4().hex[:8]}"
    worker = Worker(own_redis.url(), queue, concurrency=2)
    # heartbeats on, as a worker started by hand has them: its event dispatcher
    # is on (for worker events), so enable_events can add the task events
    worker.cmd.remove("--without-heartbeat")
    worker.start()
    flower = Flower(worker)
    hostname = worker.name.replace("%h", socket.gethostname())
    app = make_app(own_redis.url(), queue)
    try:
        assert "-E" not in worker.cmd
        wait_for(lambda: hostname in (flower.try_get("/api/workers?refresh=1") or {}), 30,
                 what="Flower sees the worker")

        def flowing() -> bool:
            """A task sent once Flower switched the events on shows up in it."""
            probe = app.tasks["t.plain"].delay("probe")
            probe.get(timeout=10)
            try:
                return bool(wait_for(lambda: flower.task(probe.id).get("state") == "SUCCESS",
                                     2, what="the probe in Flower"))
            except AssertionError:
                return False

        wait_for(flowing, 60, what="Flower switching the task events on")
        t = app.tasks["t.hold"]
        holder = t.delay(key, 3.0, "holder")
        wait_for(lambda: started(events, "holder"), 10, what="holder start")
        dup = t.delay(key, 0.0, "dup")
        value = dup.get(timeout=10)
        assert is_skipped(value) and value["holder"] == holder.id
        row = wait_for(lambda: (flower.try_get("/api/tasks?state=SKIPPED") or {}).get(dup.id),
                       15, what="the duplicate SKIPPED in Flower")
        assert row["result"] == f"duplicate of {holder.id} ({value['key']})"
        holder.get(timeout=10)
        wait_for(lambda: flower.task(holder.id).get("state") == "SUCCESS", 10,
                 what="holder done")
        assert flower.task(dup.id)["state"] == "SKIPPED"
    finally:
        flower.stop()
        discard(worker)


def test_chord_with_a_skipped_member_completes(setup, events, key):
    """A chord member skipped as a duplicate still counts as done: the body runs
    with the skip result in its place."""
    _worker, _flower, app, _ = setup
    t = app.tasks["t.hold"]
    holder = t.delay(key, 3.0, "holder")
    wait_for(lambda: started(events, "holder"), 10, what="holder start")
    other = uuid.uuid4().hex[:12]
    result = chord([t.s(key, 0.0, "member-skipped"), t.s(other, 0.0, "member-runs")],
                   app.tasks["t.collect"].s()).apply_async()
    collected = result.get(timeout=15)
    assert not holder.ready(), "the chord waited for the holder"
    assert is_skipped(collected[0]) and collected[0]["holder"] == holder.id
    assert collected[1]["tag"] == "member-runs"


def test_chain_goes_on_after_a_skipped_member(setup, events, key):
    """A skipped chain member sends the rest of the chain on, as a success would."""
    _worker, flower, app, _ = setup
    t = app.tasks["t.hold"]
    holder = t.delay(key, 3.0, "holder")
    wait_for(lambda: started(events, "holder"), 10, what="holder start")
    other = uuid.uuid4().hex[:12]
    result = chain(t.si(key, 0.0, "first-skipped"), t.si(other, 0.0, "second")).apply_async()
    assert result.get(timeout=15)["tag"] == "second"
    assert not holder.ready(), "the chain waited for the holder"
    first = result.parent
    assert is_skipped(first.get(timeout=5))
    wait_for(lambda: flower.task(first.id).get("state") == "SKIPPED", 10,
             what="the skipped chain member shown as SKIPPED")


def test_waiting_duplicate_shows_whom_it_waits_for(setup, events, key):
    """Under the retry policy, Flower shows the duplicate's RETRY with the reason
    naming the holder; it then runs and succeeds."""
    _worker, flower, app, _ = setup
    t = app.tasks["t.hold_retry"]
    holder = t.delay(key, 1.5, "holder")
    wait_for(lambda: started(events, "holder"), 10, what="holder start")
    dup = t.delay(key, 0.0, "waiter")

    def waiting() -> Any:
        info = flower.task(dup.id)
        return info if "WaitingForKey" in str(info.get("exception")) else None

    info = wait_for(waiting, 10, what="the duplicate's RETRY with its reason in Flower")
    assert holder.id in info["exception"]
    assert dup.get(timeout=20)["tag"] == "waiter"


def test_refused_send_is_refused_in_flower(setup, key):
    """A send refused at send time (queue scope) sends task-refused from the
    caller: Flower lists the refused id as REFUSED, naming the holder."""
    _worker, flower, app, _ = setup
    t = app.tasks["t.queue"]
    first = t.apply_async((key, 0.0, "first"), countdown=2)
    refused = t.delay(key, 0.0, "again")
    assert is_deduplicated(refused)
    row = wait_for(lambda: (flower.try_get("/api/tasks?state=REFUSED") or {})
                   .get(refused.refused_id), 10, what="REFUSED in Flower")
    assert row["name"] == "t.queue" and row["result"].startswith(f"duplicate of {first.id}")
    first.get(timeout=15)


def test_worker_shows_its_held_locks_in_inspect_stats_flower_and_inspect_singleton_locks(
        setup, events, key):
    """While a task holds its lock, the worker's stats (Flower's /api/workers)
    list it with task, id, key, token and age; `celery inspect singleton_locks`
    lists it too; once released it is gone."""
    worker, flower, app, hostname = setup
    t = app.tasks["t.hold"]
    holder = t.delay(key, 120.0, "holder")  # ended below, once seen held
    start = wait_for(lambda: events.starts("holder"), 10, what="holder start")[0]

    label = f"{start['lockkey']} slot 1"

    def held() -> Any:
        workers = flower.try_get("/api/workers?refresh=1") or {}
        stats = workers.get(hostname, {}).get("stats", {})
        return stats if holder.id in stats.get(label, "") else None

    # one line of text per held lock, labelled by its key and slot (Flower's
    # worker page shows each top-level entry as a row, a nested one as a repr)
    stats = wait_for(held, 10, what="the held lock in /api/workers")
    assert re.fullmatch(rf"t\.hold, held by {holder.id}, token {start['token']}, "
                        r"age \d+\.\d s, pid \d+", stats[label]), stats[label]
    assert re.fullmatch(r"\d+ held, in redis://127\.0\.0\.1:\d+/2, lease 2 s; since the "
                        r"counters began: \d+ lost, \d+ renewals failed",
                        stats["singleton locks"]), stats["singleton locks"]
    assert not [k for k, v in stats.items()
                if k.startswith("singleton") and not isinstance(v, str)], stats

    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "inspect",
         "singleton_locks", "-d", hostname, "--json", "--timeout", "5"],
        env=worker.env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert holder.id in out.stdout and start["lockkey"] in out.stdout

    events.client.set(f"finish:{key}", 1)
    holder.get(timeout=10)

    def released() -> bool:
        workers = flower.try_get("/api/workers?refresh=1") or {}
        stats = workers.get(hostname, {}).get("stats", {})
        return "singleton locks" in stats and label not in stats

    wait_for(released, 10, what="the released lock gone from the stats")


def test_each_workers_view_lists_its_own_locks_only(redis_server, setup, events, key):
    """Two workers, each running a task that holds its lock: each worker's
    stats (``celery inspect stats``, and Flower's /api/workers, its worker
    page's data) and its answer to ``celery inspect singleton_locks`` list its
    own lock and not the other's, though both publish to one lock Redis."""
    worker, flower, app, hostname = setup
    other = Worker(redis_server.url(), f"fl2-{uuid.uuid4().hex[:8]}", concurrency=2,
                   extra_args=["-E"]).start()
    try:
        other_host = other.name.replace("%h", socket.gethostname())
        other_app = make_app(redis_server.url(), other.queue)
        # not t.hold: its holds would reach the counts of t.hold the metrics
        # test reads, published after it began
        mine = app.tasks["t.hold_late"].delay(key, 120.0, "own-a")  # ended below
        theirs = other_app.tasks["t.hold_late"].delay(key + "-b", 120.0, "own-b")
        starts = {tag: wait_for(lambda t=tag: events.starts(t), 15, what=f"{tag} start")[0]
                  for tag in ("own-a", "own-b")}
        assert starts["own-a"]["lockkey"] != starts["own-b"]["lockkey"]
        labels = {tag: f"{start['lockkey']} slot 1" for tag, start in starts.items()}
        ids = {"own-a": mine.id, "own-b": theirs.id}
        own = {hostname: "own-a", other_host: "own-b"}

        def both_in_flower() -> Any:
            workers = flower.try_get("/api/workers?refresh=1") or {}
            views = {host: workers.get(host, {}).get("stats", {}) for host in own}
            return views if all(ids[tag] in views[host].get(labels[tag], "")
                                for host, tag in own.items()) else None

        views = wait_for(both_in_flower, 20, what="each held lock in its worker's stats")
        for host, tag in own.items():
            theirs_tag = "own-b" if tag == "own-a" else "own-a"
            rows = {k: v for k, v in views[host].items() if k.startswith("singleton:")}
            assert list(rows) == [labels[tag]], (host, rows)
            assert ids[theirs_tag] not in json.dumps(views[host]), (host, views[host])

        def inspect(command: str) -> dict[str, Any]:
            out = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "inspect",
                 command, "-d", f"{hostname},{other_host}", "--json", "--timeout", "5"],
                env=worker.env, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            replies = json.loads(out.stdout)
            assert set(replies) == set(own), replies
            return dict(replies)

        for host, reply in inspect("stats").items():
            rows = {k: v for k, v in reply.items() if k.startswith("singleton:")}
            assert list(rows) == [labels[own[host]]], (host, rows)
        for host, reply in inspect("singleton_locks").items():
            listed = [(lock["id"], lock["hostname"]) for lock in reply["locks"]]
            assert listed == [(ids[own[host]], host)], (host, reply)
            assert reply["held"] == 1, (host, reply)
        for k, res in ((key, mine), (key + "-b", theirs)):
            events.client.set(f"finish:{k}", 1)
            res.get(timeout=15)
    finally:
        events.client.set(f"finish:{key}", 1)
        events.client.set(f"finish:{key}-b", 1)
        discard(other)


def scrape(flower: Flower) -> dict[str, float]:
    text = flower.get("/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("celery_singleton_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_scrape_after_a_duplicate_storm_counts_skips_and_acquisitions(
        setup, events, key):
    """Flower's /metrics (through its --conf file) serves the counts every pool
    child published: N skipped duplicates add N to the skips of t.hold on this
    worker, the holder one acquisition and one hold time observation."""
    _worker, flower, app, hostname = setup
    labels = f'hostname="{hostname}",name="t.hold"'
    skips = f'celery_singleton_skips_total{{{labels},reason="duplicate"}}'
    taken = f"celery_singleton_acquisitions_total{{{labels}}}"
    held = f"celery_singleton_hold_seconds_count{{{labels}}}"

    def settled() -> Any:
        # every skip on this worker so far is a SKIPPED t.hold in Flower: once
        # the counter matches them, no earlier count is still on its way
        shown = len(flower.try_get("/api/tasks?state=SKIPPED&taskname=t.hold") or {})
        now = scrape(flower)
        # in a list: a worker that counted nothing yet scrapes as {}, which is settled
        return [now] if now.get(skips, 0) == shown else None

    [before] = wait_for(settled, 10, what="earlier skips counted")
    t = app.tasks["t.hold"]
    holder = t.delay(key, 3.0, "holder")
    wait_for(lambda: started(events, "holder"), 10, what="holder start")
    storm = [t.delay(key, 0.0, f"dup{i}") for i in range(20)]
    assert all(is_skipped(r.get(timeout=15)) for r in storm)

    def counted() -> Any:
        now = scrape(flower)
        return now if now.get(skips, 0) - before.get(skips, 0) >= 20 else None

    after = wait_for(counted, 10, what="20 skips in the scrape")
    assert after[skips] - before.get(skips, 0) == 20
    assert re.search(r'celery_singleton_locks_held\{hostname="[^"]+",name="t.hold"\} 1',
                     flower.get("/metrics"))
    holder.get(timeout=10)
    wait_for(lambda: scrape(flower).get(held, 0) - before.get(held, 0) >= 1, 10,
             what="the hold time observed")
    final = scrape(flower)
    assert final[taken] - before.get(taken, 0) == 1

    def bucket(scraped: dict[str, float], le: str) -> float:
        # the cumulative count of t.hold's holds of at most `le` seconds here
        return sum(v for k, v in scraped.items() if k.startswith(
            "celery_singleton_hold_seconds_bucket{") and f'le="{le}"' in k
            and 'name="t.hold"' in k and f'hostname="{hostname}"' in k)

    # the 3 s hold is in the 5 s bucket, not in the 1 s one
    assert bucket(final, "5.0") - bucket(before, "5.0") == 1
    assert bucket(final, "1.0") - bucket(before, "1.0") == 0


IMG = ROOT / "docs" / "img"


def check_browser(env: Mapping[str, str]) -> None:
    """Skip when chromium or chromedriver is not on ``env``'s PATH; fail instead
    where SINGLETON_REQUIRE_SERVICES=1 (.ci/run sets it)."""
    missing_programs = [name for name in ("chromium", "chromedriver")
                        if shutil.which(name, path=env.get("PATH")) is None]
    if missing_programs:
        missing(f"{' and '.join(missing_programs)} not found on PATH: install Debian's "
                "chromium and chromium-driver (.ci/run does, with --no-install-recommends)",
                env)


def test_a_missing_browser_fails_where_ci_requires_it_and_is_skipped_elsewhere(tmp_path):
    empty = {"PATH": str(tmp_path)}
    with pytest.raises(pytest.fail.Exception,
                       match="SINGLETON_REQUIRE_SERVICES=1 and chromium and chromedriver"):
        check_browser({**empty, "SINGLETON_REQUIRE_SERVICES": "1"})
    with pytest.raises(pytest.skip.Exception, match="chromium and chromedriver not found"):
        check_browser(empty)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Debian's chromium, headless, driven through chromedriver by selenium."""
    check_browser(os.environ)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="singleton-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                 "--window-size=1500,800", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_a_browser_sees_skipped_tasks_and_a_workers_held_locks_in_flower(
        setup, events, key, browser):
    """Flower's tasks page opened with ?state=SKIPPED shows the duplicate's row
    as SKIPPED with its holder; the worker page's "Other" tab shows the held
    lock. Screenshots of both go to docs/img/."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    _worker, flower, app, hostname = setup
    t = app.tasks["t.hold"]
    holder = t.delay(key, 120.0, "holder")  # ended below, once every page was seen
    start = wait_for(lambda: events.starts("holder"), 10, what="holder start")[0]
    dup = t.delay(key, 0.0, "dup")
    assert is_skipped(dup.get(timeout=10))
    wait_for(lambda: (flower.try_get("/api/tasks?state=SKIPPED") or {}).get(dup.id), 10,
             what="the duplicate known to Flower")

    browser.get(f"{flower.base}/tasks?state=SKIPPED")
    row = WebDriverWait(browser, 15).until(ec.visibility_of_element_located((By.ID, dup.id)))
    WebDriverWait(browser, 10).until(lambda _: holder.id in row.text)
    assert "SKIPPED" in row.text and "t.hold" in row.text
    assert f"duplicate of {holder.id}" in row.text
    shown = [r.get_attribute("id") for r in browser.find_elements(By.CSS_SELECTOR,
                                                                  "#tasks-table tbody tr")]
    states = [s for s in (flower.task(i).get("state") for i in shown if i)]
    assert states and set(states) == {"SKIPPED"}, "the page lists only skipped tasks"
    IMG.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(IMG / "flower-tasks-skipped.png"))

    label = f"{start['lockkey']} slot 1"

    def lock_in_stats() -> bool:
        workers = flower.try_get("/api/workers?refresh=1") or {}
        return holder.id in workers.get(hostname, {}).get("stats", {}).get(label, "")

    wait_for(lock_in_stats, 10, what="the held lock in the worker's stats")
    browser.get(f"{flower.base}/worker/{hostname}")
    WebDriverWait(browser, 15).until(
        ec.element_to_be_clickable((By.ID, "worker-tab-other"))).click()
    pane = WebDriverWait(browser, 10).until(
        ec.visibility_of_element_located((By.ID, "tab-other")))
    # a row sums the worker's locks up, and each held lock is a row of its own,
    # labelled by its key and slot, a line of text (no dict's repr anywhere)
    assert "{'" not in pane.text and "[{" not in pane.text, pane.text
    cells = {row.find_elements(By.TAG_NAME, "td")[0].text:
             row.find_elements(By.TAG_NAME, "td")[1].text
             for row in pane.find_elements(By.CSS_SELECTOR, "tbody tr")}
    assert re.fullmatch(r"\d+ held, in redis://\S+, lease 2 s; since the counters began: "
                        r"\d+ lost, \d+ renewals failed", cells["singleton locks"]), cells
    assert re.fullmatch(rf"t\.hold, held by {holder.id}, token {start['token']}, "
                        r"age \d+\.\d s, pid \d+", cells[label]), cells
    row = next(r for r in pane.find_elements(By.CSS_SELECTOR, "tbody tr") if label in r.text)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
    browser.save_screenshot(str(IMG / "flower-worker-locks.png"))

    # the holder's own page names its lock: key, slot, token and age
    browser.get(f"{flower.base}/task/{holder.id}")
    shown = WebDriverWait(browser, 15).until(
        lambda b: "Singleton lock" in b.page_source and b.find_element(By.TAG_NAME, "body"))
    text = " ".join(shown.text.split())
    assert re.search(rf"Singleton lock {re.escape(start['lockkey'])} slot 1, token "
                     rf"{start['token']}, held \d+\.\d s", text), text
    field = browser.find_element(By.XPATH, "//dt[normalize-space()='Singleton lock']")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center', behavior: 'instant'})",
                           field)
    browser.save_screenshot(str(IMG / "flower-task-lock.png"))
    events.client.set(f"finish:{key}", 1)
    holder.get(timeout=15)


def test_celery_singleton_metrics_serves_the_lock_series_on_its_own_port(setup, events, key):
    """`celery -A app singleton metrics --port N` serves the same series as
    Flower's /metrics, without Flower: a lock taken shows in its acquisitions."""
    worker, _flower, app, hostname = setup
    log = Path(tempfile.mkdtemp(prefix="singleton-metrics-")) / "metrics.log"

    def spawn(port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "singleton",
             "metrics", "--port", str(port), "--address", "127.0.0.1"],
            env=worker.env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log.open("wb"),
            start_new_session=True)

    proc, port = serve_on_free_port(spawn, lambda: log.read_text(errors="replace"),
                                    lambda p: _answers(f"http://127.0.0.1:{p}/metrics"),
                                    what="celery singleton metrics")
    series = f'celery_singleton_acquisitions_total{{hostname="{hostname}",name="t.hold"}}'

    def value() -> Any:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        found = re.search(re.escape(series) + r" (\S+)", text)
        return float(found.group(1)) if found else 0.0

    try:
        wait_for(lambda: value() is not None, 20, what="metrics served")
        before = value() or 0.0
        app.tasks["t.hold"].delay(key, 0.0, "one").get(timeout=10)
        wait_for(lambda: (value() or 0) >= before + 1, 10, what="the acquisition counted")
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(log.parent, ignore_errors=True)


def test_held_locks_of_a_process_that_stopped_publishing_are_ignored_and_removed(redis_server):
    """A killed pool process leaves its last held-locks entry behind: once older
    than HELD_MAX_AGE it is neither shown nor kept."""
    import time as clock

    from celery_singleton_lock.config import SingletonConfig
    from celery_singleton_lock.engine.registry import connect
    from celery_singleton_lock.observe import monitor

    client = redis_server.client(4)
    engine = connect(SingletonConfig.defaults(redis_server.url(4)))
    client.delete(monitor.held_key("singleton:"))
    lock = {"task": "t.hold", "id": "x", "key": "singleton:{ab}", "token": 7, "since": 0.0}
    now = clock.time()
    client.hset(monitor.held_key("singleton:"), mapping={
        "w1@h|1": json.dumps({"ts": now, "pid": 1, "locks": [dict(lock, since=now - 3)]}),
        "w1@h|2": json.dumps({"ts": now - monitor.HELD_MAX_AGE - 1, "pid": 2,
                              "locks": [dict(lock, id="dead")]}),
    })
    rows = monitor.read_held(engine, "singleton:", "w1@h")
    assert [(r["id"], r["pid"], r["token"]) for r in rows] == [("x", 1, 7)]
    assert 2.5 < rows[0]["age"] < 10
    assert client.hkeys(monitor.held_key("singleton:")) == ["w1@h|1"]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
