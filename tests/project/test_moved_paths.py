"""0.1's six documented import paths still work in 0.2, each with a
``DeprecationWarning`` that names the import to write instead, and hand out
the very objects the new paths do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)

#: 0.1's import -> the one the warning names (what the object is now)
MOVED = {
    "from celery_singleton_lock.overlap import cancel_requested":
        "from celery_singleton_lock import cancel_requested",
    "from celery_singleton_lock.metrics import register":
        "from celery_singleton_lock.observe.metrics import register",
    "from celery_singleton_lock.masking import install":
        "from celery_singleton_lock import install_masking",
    "from celery_singleton_lock.replies import record":
        "from celery_singleton_lock import owner_record",
    "from celery_singleton_lock.checks import acl_rule":
        "from celery_singleton_lock import acl_rule",
    "from celery_singleton_lock.checks import run_checks":
        "from celery_singleton_lock import run_checks",
}

# each old import in a fresh interpreter: a module's import-time warning comes once
PROBE = """
import sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(old, (was := {}))
exec(new, (now := {}))
name = old.rsplit(" ", 1)[1]
assert was[name] is now[new.rsplit(" ", 1)[1]], (was[name], now)
print("|".join(f"{w.category.__name__}: {w.message}" for w in caught))
"""


def test_each_old_path_imports_with_a_warning_naming_the_new_one() -> None:
    for old, new in MOVED.items():
        out = subprocess.run([sys.executable, "-c", PROBE, old, new], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, old + "\n" + out.stderr
        warned = [w for w in out.stdout.strip().split("|") if w.startswith("Deprecation")]
        assert len(warned) == 1 and new in warned[0] and "0.3" in warned[0], (old, out.stdout)


def test_the_new_paths_warn_of_nothing() -> None:
    code = ("import warnings; warnings.simplefilter('error')\n"
            + "\n".join(set(MOVED.values())) + "\nimport celery_singleton_lock.checks.doctor")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
