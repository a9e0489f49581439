"""The Grafana dashboard (examples/grafana/celery-singleton-lock.json) asks only
for series the library exports, and the compose stack provisions it next to
Prometheus.

A real worker with the metrics on (``celery singleton metrics``) is scraped:
every metric name a panel or a variable uses is in the scrape. A real
Prometheus (Debian's ``prometheus``) then scrapes it and evaluates every
panel's query; the picture in the docs is drawn from it
(examples/grafana/preview.py) and taken with headless Chromium.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import ROOT, RedisServer, Worker, discard, missing, serve_on_free_port, wait_for

pytestmark = pytest.mark.worker

GRAFANA = ROOT / "examples" / "grafana"
DASHBOARD = GRAFANA / "celery-singleton-lock.json"
IMG = ROOT / "docs" / "img"
#: seconds of work for the docs' picture (SINGLETON_DASHBOARD_SECONDS=90 for the
#: one in docs/img); by default the few seconds the checks need
PICTURE_SECONDS = float(os.environ.get("SINGLETON_DASHBOARD_SECONDS") or 0)


def queries() -> list[str]:
    """Every PromQL of the dashboard: its panels' targets and its variables'."""
    dash = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    found += [v["query"]["query"] for v in dash["templating"]["list"]]
    return found


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bcelery_singleton_[a-z_]+\b", expr))


def test_the_compose_stack_provisions_the_dashboard_next_to_prometheus():
    """docker-compose.yml (parsed: no Docker engine here): Prometheus scrapes
    the ``metrics`` service's port; Grafana gets the data source whose uid
    every panel names, and the dashboard where its provider looks."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    metrics = services["metrics"]["command"]
    assert metrics[:5] == ["celery", "-A", "proj", "singleton", "metrics"]
    port = metrics[metrics.index("--port") + 1]

    def mounts(service: str) -> dict[str, Path]:
        out = {}
        for volume in services[service]["volumes"]:
            source, target = volume.split(":")[:2]
            out[target] = (ROOT / source).resolve()
            assert out[target].exists(), volume
        return out

    prometheus = yaml.safe_load(mounts("prometheus")["/etc/prometheus/prometheus.yml"]
                                .read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]
    assert targets == [f"metrics:{port}"]

    grafana = mounts("grafana")
    provisioning = grafana["/etc/grafana/provisioning"]
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    [datasource] = source["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    [provider] = yaml.safe_load((provisioning / "dashboards" / "celery-singleton-lock.yml")
                                .read_text())["providers"]
    placed = [t for t in grafana if t.startswith(provider["options"]["path"] + "/")]
    assert [grafana[t] for t in placed] == [DASHBOARD.resolve()]
    dash = json.loads(DASHBOARD.read_text())
    named = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])}
    named |= {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert named == {datasource["uid"]}


@pytest.fixture(scope="module")
def scraped(redis_server: RedisServer) -> Iterator[dict[str, Any]]:
    """A worker that took, skipped, refused and queued locks, and
    ``celery singleton metrics`` serving its counts: its port and the queue."""
    queue = f"dash-{uuid.uuid4().hex[:8]}"
    worker = Worker(redis_server.url(), queue, concurrency=3).start()
    log = Path(tempfile.mkdtemp(prefix="singleton-dashboard-")) / "metrics.log"

    def spawn(port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.workerapp:app", "singleton",
             "metrics", "--port", str(port), "--address", "127.0.0.1"],
            env=worker.env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log.open("wb"),
            start_new_session=True)

    proc, port = serve_on_free_port(spawn, lambda: log.read_text(errors="replace"),
                                    lambda p: _get(f"http://127.0.0.1:{p}/metrics") is not None,
                                    what="celery singleton metrics")
    try:
        from tests.workerapp import make_app

        yield {"port": port, "app": make_app(redis_server.url(), queue)}
    finally:
        proc.terminate()
        proc.wait(10)
        discard(worker)
        shutil.rmtree(log.parent, ignore_errors=True)


def work(app: Any, rounds: int = 1) -> None:
    """Locks taken and held, duplicates skipped, sends refused, duplicates
    sent to wait: the events the dashboard counts."""
    for _ in range(rounds):
        key = uuid.uuid4().hex[:8]
        holder = app.tasks["t.hold"].delay(key, 0.6, "holder")
        first = app.tasks["t.collect"].delay([key])
        refused = app.tasks["t.collect"].delay([key])  # queue scope: refused at send
        dups = [app.tasks["t.hold"].apply_async((key, 0.0, "dup"), countdown=0.2)
                for _ in range(3)]
        waiting = [app.tasks["t.hold_retry"].delay(key, 0.3, "wait") for _ in range(2)]
        for result in (holder, first, refused, *waiting, *dups):
            result.get(timeout=30)


#: the series names a family of each type gives PromQL (a family with no sample
#: yet, a counter nothing counted, is declared all the same)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def scrape(port: int) -> tuple[set[str], set[str]]:
    """(every series name the scrape declares, those with a sample)."""
    text = _get(f"http://127.0.0.1:{port}/metrics") or ""
    declared, sampled = set(), set()
    for family in text_string_to_metric_families(text):
        declared |= {family.name + end for end in SUFFIXES.get(family.type, ("",))}
        sampled |= {sample.name for sample in family.samples}
    return declared, sampled


def test_every_series_the_dashboard_queries_is_exported_by_a_real_worker(scraped):
    work(scraped["app"])
    wanted = set().union(*(metric_names(q) for q in queries()))
    assert len(wanted) >= 10, wanted

    produced = {"celery_singleton_acquisitions_total", "celery_singleton_skips_total",
                "celery_singleton_refusals_total", "celery_singleton_waits_total",
                "celery_singleton_locks_held", "celery_singleton_acquire_seconds_bucket",
                "celery_singleton_hold_seconds_bucket", "celery_singleton_redis_up",
                "celery_singleton_redis_scrape_seconds"}
    have, sampled = wait_for(lambda: (lambda d, s: (d, s) if produced - {
        "celery_singleton_locks_held"} <= s else None)(*scrape(scraped["port"])), 20,
        what="the worker's counts published")
    # what nothing here made happen (a lock lost, a renewal or the lock Redis
    # failing) is declared with no sample; everything else has samples
    assert wanted - sampled <= {"celery_singleton_losses_total",
                                "celery_singleton_renewal_failures_total",
                                "celery_singleton_backend_errors_total",
                                "celery_singleton_locks_held"}, sorted(wanted - sampled)
    assert wanted <= have, sorted(wanted - have)


def test_a_real_prometheus_evaluates_every_panel_and_the_docs_picture_is_drawn_from_it(
        scraped):
    """Prometheus scrapes the worker's series every second; each panel's query
    (and each variable's) is valid PromQL there, and those over what the
    worker did return data. The docs' picture of the dashboard is drawn from
    this Prometheus and taken with headless Chromium."""
    binary = shutil.which("prometheus")
    if binary is None:
        missing("no prometheus binary (Debian's package prometheus)")
    home = Path(tempfile.mkdtemp(prefix="singleton-prometheus-"))
    (home / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "celery-singleton-lock", "static_configs": [
            {"targets": [f"127.0.0.1:{scraped['port']}"]}]}]}))
    log = home / "prometheus.log"

    def spawn(port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [binary, f"--config.file={home / 'prometheus.yml'}",
             f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            cwd=str(home), stdout=subprocess.DEVNULL, stderr=log.open("wb"),
            start_new_session=True)

    proc, port = serve_on_free_port(spawn, lambda: log.read_text(errors="replace"),
                                    lambda p: _get(f"http://127.0.0.1:{p}/-/ready") is not None,
                                    what="prometheus")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _query(base, "up == 1"), 30, what="Prometheus scraping the metrics")
        started = time.monotonic()
        work(scraped["app"], rounds=6)
        while time.monotonic() - started < PICTURE_SECONDS:  # a longer picture, on demand
            work(scraped["app"], rounds=1)
        wait_for(lambda: _query(base, "increase(celery_singleton_skips_total[5m]) > 0"), 30,
                 what="Prometheus to have scraped the skips twice")
        expand = _preview().expand

        empty = []
        for query in queries():
            expr = expand(query, 300, 4) if "label_values" not in query else (
                query.split("(", 1)[1].split(",")[0])
            result = _query(base, expr)  # raises on a query Prometheus refuses
            if not result:
                empty.append(query)
        # nothing was lost, no renewal failed, the lock Redis never failed here,
        # and no lock is held once the work is done
        assert all(any(m in q for m in ("losses", "renewal_failures", "backend_errors",
                                        "locks_held")) for q in empty), empty
        _picture(base, max(PICTURE_SECONDS, 60) / 60)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)


def _picture(base: str, minutes: float) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        missing("no chromium for the dashboard's picture")
    render = _preview().render
    page = Path(tempfile.mkdtemp(prefix="singleton-preview-")) / "dashboard.html"
    page.write_text(render(base, minutes))
    # the docs' picture only from a run made for it; else drawn all the same, and dropped
    out = IMG / "grafana-dashboard.png" if PICTURE_SECONDS else page.with_suffix(".png")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--screenshot={out}", "--window-size=1584,1250",
                    page.as_uri()], check=True, capture_output=True, timeout=60)
    assert out.stat().st_size > 10_000
    shutil.rmtree(page.parent, ignore_errors=True)


def _preview() -> Any:
    """examples/grafana/preview.py, the docs picture's renderer."""
    spec = importlib.util.spec_from_file_location("dashboard_preview", GRAFANA / "preview.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _query(base: str, expr: str) -> list[Any]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())
    except OSError:
        return None
