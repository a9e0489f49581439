"""The documentation site builds strictly, and the code the docs say runs, runs.

A page marks a block that runs with an HTML comment on the line before it
(invisible on the site and on GitHub)::

    <!-- runs: SCENARIO file NAME -->   the block is the file NAME
    <!-- runs: SCENARIO worker -->      the block is a `celery ... worker` command
    <!-- runs: SCENARIO beat -->        the block is a `celery ... beat` command
    <!-- runs: SCENARIO run -->         the block is run with Python
    <!-- runs: SCENARIO output -->      what that run prints

Each scenario runs in a fresh directory against a redis-server of its own
(``localhost:6379`` in the blocks becomes that server) and, when it has a worker
block, that worker as a subprocess on a queue of its own; a beat block starts
that beat as a subprocess once the worker is ready (it sends to the same queue).
Task ids and key hashes are compared as shapes, everything else exactly.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import uuid
import venv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from celery_singleton_lock.testing import CeleryWorker, RedisServer
from tests.support import ROOT, discard, missing

DOCS = ROOT / "docs"
MARKED = re.compile(
    r"<!-- runs: (?P<scenario>[\w-]+) (?P<role>file|worker|beat|run|output)(?: (?P<arg>\S+))? -->\n"
    r"```[^\n]*\n(?P<body>.*?)\n```",
    re.DOTALL,
)
# an app module is pointed at the scenario's own queue
QUEUE_LINE = '\nimport os as _os\napp.conf.task_default_queue = _os.environ["DOCS_QUEUE"]\n'


@dataclass
class Scenario:
    page: str
    name: str
    files: dict[str, str] = field(default_factory=dict)
    worker: Optional[str] = None
    beat: Optional[str] = None
    runs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.name}"

    @property
    def needs_rabbitmq(self) -> bool:
        return any("amqp://" in text for text in self.files.values())


def scenarios() -> list[Scenario]:
    found: dict[tuple[str, str], Scenario] = {}
    for page in sorted(DOCS.glob("*.md")):
        for m in MARKED.finditer(page.read_text()):
            sc = found.setdefault((page.name, m["scenario"]), Scenario(page.name, m["scenario"]))
            body = m["body"]
            if m["role"] == "file":
                sc.files[m["arg"]] = body
            elif m["role"] == "worker":
                sc.worker = body.strip()
            elif m["role"] == "beat":
                sc.beat = body.strip()
            elif m["role"] == "run":
                sc.runs.append(body)
            else:
                sc.outputs.append(body)
    return list(found.values())


def shape(text: str) -> str:
    text = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<id>", text)
    text = re.sub(r"\{[0-9a-f]{32}\}", "{<hash>}", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def rabbitmq_reachable() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        return True
    except OSError:
        return False


#: the README's docs command, as the test below runs it: no ``-q`` nor ``-v``, which
#: keep mkdocs's warnings from the count ``--strict`` fails on (mkdocs 1.6 sets
#: its logger's level to ERROR for ``-q``: a warning is then never counted)
DOCS_COMMAND = ("mkdocs", "build", "--strict")


def clean_env() -> dict[str, str]:
    """The environment without what points into this suite's own venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


@pytest.fixture(scope="module")
def docs_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding this checkout installed with exactly its ``[docs]`` extra
    (``pip install -e '.[docs]'``, as the README says), none of the test
    dependencies. Made once and kept in pytest's cache (``.pytest_cache/d/``);
    made again when the package's dependencies, the extra, this checkout's
    place or the Python change."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = json.dumps({"root": str(ROOT), "python": sys.version,
                         "dependencies": project["dependencies"],
                         "docs": project["optional-dependencies"]["docs"]}, sort_keys=True)
    cache = getattr(request.config, "cache", None)
    base = cache.mkdir("docs-extra-venv") if cache else tmp_path_factory.mktemp("docs-extra")
    env_dir, stamp = base / "venv", base / "made-for.json"
    with open(base / "lock", "w") as lock:  # two runs of one checkout make it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.exists() and stamp.read_text() == wanted):
            stamp.unlink(missing_ok=True)
            venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
            out = subprocess.run(
                [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "-e",
                 f"{ROOT}[docs]"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                timeout=600)
            assert out.returncode == 0, out.stdout + out.stderr
            stamp.write_text(wanted)
    return env_dir


@pytest.mark.long
def test_the_readme_docs_command_builds_the_site_with_only_the_docs_extra(
        docs_env: Path, tmp_path: Path) -> None:
    """`pip install -e '.[docs]' && mkdocs build --strict`, in a venv holding
    that extra and nothing of the tests': a broken link or anchor, a missing page
    or image, a nav entry without its file, a docstring mkdocstrings cannot
    render, or a plugin or extension the extra leaves out fails the suite."""
    readme = (ROOT / "README.md").read_text()
    assert "`pip install -e '.[docs]' && " + " ".join(DOCS_COMMAND) + "`" in readme
    env = clean_env()
    installed = subprocess.run([str(docs_env / "bin" / "python"), "-m", "pip", "list",
                                "--format=freeze"], env=env, capture_output=True, text=True,
                               timeout=60, check=True).stdout.lower()
    assert "celery-singleton-lock" in installed or "celery_singleton_lock" in installed
    assert "pytest" not in installed, "the docs venv holds a test dependency"
    out = subprocess.run([str(docs_env / "bin" / DOCS_COMMAND[0]), *DOCS_COMMAND[1:],
                          "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "requires either Black or Ruff" not in log, "the reference's signatures unformatted"
    site = tmp_path / "site"
    for page in ("getting-started", "concepts", "migration", "redis-keys", "reference"):
        assert (site / page / "index.html").exists(), page
    assert (site / "benchmarks" / "results" / "throughput.png").exists(), "plots are served"
    reference = (site / "reference" / "index.html").read_text()
    assert "SingletonTask" in reference and "StaleTokenError" in reference


def test_every_marked_block_belongs_to_a_complete_scenario():
    """A marked block that no scenario would run (a typo in its marker) fails here."""
    marks = sum(page.read_text().count("<!-- runs: ") for page in DOCS.glob("*.md"))
    found = scenarios()
    blocks = sum(len(s.files) + bool(s.worker) + bool(s.beat) + len(s.runs) + len(s.outputs)
                 for s in found)
    assert marks == blocks, "a <!-- runs: --> marker is not followed by a code block"
    for sc in found:
        assert sc.runs, f"{sc.id}: nothing to run"
        assert len(sc.outputs) == len(sc.runs), f"{sc.id}: every run block needs its output"
        assert sc.beat is None or sc.worker, f"{sc.id}: a beat needs a worker to run its ticks"
    assert {"getting-started.md:redis", "getting-started.md:rabbitmq"} <= {s.id for s in found}


@pytest.mark.worker
@pytest.mark.parametrize("sc", scenarios(), ids=lambda s: s.id)
def test_marked_blocks_run_and_print_what_the_page_says(sc: Scenario, tmp_path: Path):
    """Each scenario's files, worker command and scripts, run as a reader runs them,
    print exactly the output the page shows."""
    if sc.needs_rabbitmq and not rabbitmq_reachable():
        missing("no RabbitMQ answers on 127.0.0.1:5672")
    queue = f"docs-{uuid.uuid4().hex[:8]}"
    with RedisServer() as server:
        here = f"127.0.0.1:{server.port}"
        for name, text in sc.files.items():
            text = text.replace("localhost:6379", here)
            if "app = Celery(" in text:
                text += QUEUE_LINE
            (tmp_path / name).write_text(text)
        env = {"DOCS_QUEUE": queue,
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        worker = None
        if sc.worker is not None:
            argv = shlex.split(sc.worker)
            assert argv[0] == "celery" and "worker" in argv, sc.worker
            worker = CeleryWorker(argv[argv.index("-A") + 1], queue, env=env, cwd=str(tmp_path))
            worker.cmd = [sys.executable, "-m", *argv, "-Q", queue, "-n", worker.name,
                          "--without-gossip", "--without-mingle", "--without-heartbeat",
                          "-f", str(worker.log)]
            worker.start()
        beat = None
        if sc.beat is not None:
            beat = start_beat(sc.beat, tmp_path, env)
        try:
            for code, expected in zip(sc.runs, sc.outputs):
                out = subprocess.run([sys.executable, "-c", code.replace("localhost:6379", here)],
                                     cwd=tmp_path, env={**os.environ, **env},
                                     capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, out.stdout + out.stderr + (
                    worker.logs() if worker else "") + beat_logs(tmp_path)
                assert shape(out.stdout) == shape(expected), out.stdout + beat_logs(tmp_path)
        finally:
            if beat is not None:
                stop(beat)
            if worker is not None:
                discard(worker)


def start_beat(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The page's `celery ... beat` command as a subprocess, its log in ``beat.log``."""
    argv = shlex.split(command)
    assert argv[0] == "celery" and "beat" in argv, command
    return subprocess.Popen(
        [sys.executable, "-m", *argv, "-s", str(cwd / "beat-schedule"), "--pidfile=",
         "-f", str(cwd / "beat.log")],
        cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def beat_logs(cwd: Path) -> str:
    log = cwd / "beat.log"
    return log.read_text(errors="replace") if log.exists() else ""


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_the_readme_quick_start_is_the_getting_started_code_the_suite_runs():
    """The README's Quick start blocks are, verbatim, the blocks of
    docs/getting-started.md that test_marked_blocks_run... runs and checks."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    page = (ROOT / "docs" / "getting-started.md").read_text()
    ran = re.findall(r"<!-- runs: redis [^>]*-->\n(```[a-z]*\n.*?```)", page, flags=re.S)
    shown = re.findall(r"(```[a-z]*\n.*?```)", quick, flags=re.S)
    assert shown and shown == ran


@pytest.mark.worker
def test_the_limit_pages_example_skips_nothing_with_fewer_processes_than_calls(tmp_path: Path):
    """docs/limit.md: a skip depends on what holds the slots when a call starts.
    Its example run by a worker of two processes (the page says so): the third
    call waits for a process, starts once a slot is free and runs, so nothing
    is skipped."""
    page = (DOCS / "limit.md").read_text()
    assert "`--concurrency 2`), the third call waits in the queue for a process" in page
    [sc] = [s for s in scenarios() if s.id == "limit.md:limit"]
    assert sc.worker is not None and "--concurrency 3" in sc.worker
    queue = f"docs-{uuid.uuid4().hex[:8]}"
    with RedisServer() as server:
        here = f"127.0.0.1:{server.port}"
        for name, text in sc.files.items():
            (tmp_path / name).write_text(text.replace("localhost:6379", here) + QUEUE_LINE)
        env = {"DOCS_QUEUE": queue,
               "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        worker = CeleryWorker("tasks", queue, concurrency=2, env=env, cwd=str(tmp_path)).start()
        try:
            code = sc.runs[0].replace("localhost:6379", here)
            out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                                 env={**os.environ, **env}, capture_output=True, text=True,
                                 timeout=60)
        finally:
            discard(worker)
    assert out.returncode == 0, out.stderr
    ran, skipped, _late = out.stdout.splitlines()
    assert skipped == "0 skipped", out.stdout
    assert json.loads(ran) in ([1, 1, 2], [1, 2, 2]), out.stdout


def test_the_commands_the_compatibility_page_names_are_the_lock_scripts_own():
    """docs/compatibility.md lists the commands the lock scripts call (what a
    server must have): exactly those read from the scripts' sources."""
    from celery_singleton_lock.checks.permissions import SCRIPTS, script_commands

    text = (ROOT / "docs" / "compatibility.md").read_text()
    start = text.index("The lock scripts use only")
    paragraph = text[start:text.index("Beat's buffers", start)]
    named = {m.lower() for m in re.findall(r"`([A-Z]+)(?: \.\.\. PX)?`", paragraph)}
    called = {c for script in SCRIPTS.values() for c in script_commands(script)}
    assert named == called, (sorted(named - called), sorted(called - named))


def test_the_client_defaults_the_deployments_page_gives_are_the_library_s():
    """docs/redis-deployments.md states the redis-py client's defaults: they
    are what :data:`CLIENT_DEFAULTS` hands to redis-py."""
    from celery_singleton_lock.engine.servers import CLIENT_DEFAULTS

    text = " ".join((ROOT / "docs" / "redis-deployments.md").read_text().split())
    found = re.search(r"own defaults: (\d+) s timeouts, a (\d+) s health check, at most "
                      r"(\d+) pooled connections", text)
    assert found, "the sentence giving the client's defaults is gone"
    timeouts, health, pooled = (int(g) for g in found.groups())
    assert CLIENT_DEFAULTS["socket_timeout"] == CLIENT_DEFAULTS["socket_connect_timeout"] == \
        timeouts
    assert (CLIENT_DEFAULTS["health_check_interval"], CLIENT_DEFAULTS["max_connections"]) == (
        health, pooled)
