"""The hot path on one standalone Redis, this version against an earlier one.

    python -m benchmarks.deploy_ab --before REV [--rounds 7] [--pairs 20000]

Each version (the working tree, and ``REV`` unpacked with ``git archive`` into
a temporary folder) drives acquire + release pairs through its own
``LockEngine`` in a fresh process against the same ``redis-server``, which
the run starts itself. Versions alternate within each round; per pair it
reports the client's CPU, the wall time and the CPU the Redis server spent
(``INFO cpu`` before and after). Medians over the rounds, and their range.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import redis

from celery_singleton_lock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent

#: run in a fresh interpreter with the version's package first on the path
DRIVER = r"""
import json, sys, time, uuid
from celery_singleton_lock import SingletonConfig
try:
    from celery_singleton_lock.engine.server import LockEngine
except ImportError:  # versions where the engine lived in lock.py
    from celery_singleton_lock.lock import LockEngine
from celery_singleton_lock.keys import LockKeys

port, pairs = int(sys.argv[1]), int(sys.argv[2])
url = f"redis://127.0.0.1:{port}/5"
if hasattr(SingletonConfig, "defaults"):
    config = SingletonConfig.defaults(url)
else:  # versions that read settings from an app only
    from celery import Celery
    app = Celery(set_as_current=False)
    app.conf.singleton_redis_url = url
    config = SingletonConfig.from_app(app)
try:
    from celery_singleton_lock.engine.registry import connect
except ImportError:  # versions before the registry
    connect = LockEngine.from_config
engine = connect(config)
keys = [LockKeys("singleton:", uuid.uuid4().hex) for _ in range(64)]

try:  # one request value (0.2 and later), or the keywords it replaced
    from celery_singleton_lock.engine.request import Lease, Request

    def take(k, exec_id):
        engine.acquire(k, Request("t", exec_id, Lease(5.0), "h", task_name="t"))
except ImportError:
    def take(k, exec_id):
        engine.acquire(k, task_id="t", exec_id=exec_id, lease_ms=5000, hostname="h",
                       retries=0, task_name="t")

def pair(k, exec_id):
    take(k, exec_id)
    engine.release(k, exec_id, "t")

for k in keys:  # warm: connections made, scripts loaded
    pair(k, "w")
print("ready", flush=True)
sys.stdin.readline()
cpu0, wall0 = time.process_time(), time.perf_counter()
for i in range(pairs):
    pair(keys[i % 64], "e")
cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
settle = getattr(engine, "settle", None)
if settle is not None:
    settle()
print(json.dumps({"client_cpu_us": cpu / pairs * 1e6, "wall_us": wall / pairs * 1e6}),
      flush=True)
"""


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def unpack(rev: str, into: Path) -> Path:
    """``rev``'s tree in ``into``; the folder that holds its package."""
    data = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "src" if (into / "src" / "celery_singleton_lock").is_dir() else into


def run_once(package_root: Path, server: RedisServer, pairs: int) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(server.port), str(pairs)],
                            cwd=package_root, env={"PYTHONPATH": str(package_root),
                                                   "PATH": "/usr/bin:/bin"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    client = server.client()
    before = redis_cpu(client)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    result: dict[str, float] = json.loads(proc.stdout.readline())
    result["redis_cpu_us"] = (redis_cpu(client) - before) / pairs * 1e6
    proc.wait(30)
    return result


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=20000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server:
        versions = {args.before: unpack(args.before, Path(tmp)), "this tree": ROOT}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
        for i in range(args.rounds):
            order = list(versions) if i % 2 == 0 else list(reversed(versions))
            for name in order:
                runs[name].append(run_once(versions[name], server, args.pairs))
        print(f"acquire + release pairs on one redis-server ({args.pairs} per run, "
              f"{args.rounds} rounds, medians and ranges, µs per pair)\n")
        print("| version | client CPU | wall time | Redis CPU |\n|---|---:|---:|---:|")
        for name, rows in runs.items():
            cells = []
            for field in ("client_cpu_us", "wall_us", "redis_cpu_us"):
                values = [r[field] for r in rows]
                cells.append(f"{statistics.median(values):.1f} "
                             f"({min(values):.1f}-{max(values):.1f})")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
