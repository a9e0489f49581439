"""examples/beat: two beats, one killed with SIGKILL, every tick sent exactly once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.worker


def test_beat_demo_sends_every_tick_once_with_two_beats_and_one_killed():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "beat" / "run_demo.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "was sent exactly once" in out.stdout
    ticks = [line for line in out.stdout.splitlines() if line.strip().startswith("tick ")]
    assert len(ticks) >= 8 and len({line.split()[1] for line in ticks}) == len(ticks)
