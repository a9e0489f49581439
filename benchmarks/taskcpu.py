"""What the lock costs the task's own process, in instructions (valgrind's callgrind).

    python -m benchmarks.taskcpu                         # this checkout: ours and plain Celery
    python -m benchmarks.taskcpu --tree /tmp/before      # another checkout beside it
    python -m benchmarks.taskcpu --peers                 # and the peers' worker side

One task is one call of the tracer a worker's pool process runs for each
message (``celery.app.trace.build_tracer``, not eager) around a no-op task,
each call on a key of its own, the lock on a redis-server started here: the
acquire and release round trips and all the Python around them; the
heartbeat thread starts as in a worker, and its rounds cost per interval, not
per task. A child process runs
the calls under callgrind twice, once with ``--tasks`` calls and once with
none, and the difference over ``--tasks`` is the instructions per task:
imports, start-up and the warm-up (connecting, loading the scripts) cancel out.
``PYTHONHASHSEED`` is fixed, so the counts repeat closely. ``--tree`` puts another checkout's
``celery_singleton_lock`` first on the child's path, the way a change is
measured against the code before it (``git worktree add /tmp/before <commit>``).

``--peers`` measures celery-singleton's and celery-once's tasks the same way:
their worker side only (the release's ``DEL`` and the Python around it);
they take their lock when the task is sent, which is not in here.

The waiting on Redis is not counted: instructions are the CPU a worker pays,
whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from celery_singleton_lock.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent

#: the child: ``python -c CHILD <kind> <calls> <redis url>``
CHILD = """
import sys, uuid
from celery import Celery
from celery.app.trace import build_tracer
kind, calls, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = Celery("taskcpu", broker="memory://", set_as_current=False)
app.conf.update(singleton_redis_url=url, task_ignore_result=True)
if kind == "ours":
    from celery_singleton_lock import SingletonTask
    options = {"base": SingletonTask}
elif kind == "celery-singleton":  # the peers' worker side (their send side is not here)
    from celery_singleton import Singleton
    app.conf.singleton_backend_url = url
    options = {"base": Singleton}
elif kind == "celery-once":
    from celery_once import QueueOnce
    app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                     "settings": {"url": url, "default_timeout": 3600}}
    options = {"base": QueueOnce}
else:
    options = {}

@app.task(name="taskcpu.noop", bind=True, **options)
def noop(self, i):
    return self.singleton.token if i == "probe" else None

app.finalize()
# the tracer a worker's pool process calls with each message's request
trace = build_tracer(noop.name, noop, eager=False, propagate=True, app=app,
                     hostname="taskcpu@bench")
ids = [uuid.uuid4().hex for _ in range(calls + 51)]

def call(n, task_id):
    request = {"id": task_id, "task": noop.name, "hostname": "taskcpu@bench",
               "delivery_info": {"exchange": "", "routing_key": "celery",
                                 "redelivered": False}, "retries": 0}
    info = trace(task_id, (n,), {}, request)
    if info[1] is not None:  # the failed state's exception info
        raise SystemExit(f"call {n} failed: {info[0]!r}")
    return info[0]

for i in range(-50, 0):
    call(i, ids[i])
for i in range(calls):
    call(i, ids[i])
print("base", type(app.tasks[noop.name]).__bases__[0].__name__)
if kind == "ours":  # the calls above ran under the lock: one more tells its token
    token = call("probe", ids[calls])
    if not token:
        raise SystemExit(f"no lock was taken (token {token!r})")
    print("token", token)
"""


def instructions(kind: str, calls: int, url: str, tree: Optional[Path]) -> int:
    """Instructions callgrind counts for the whole child with ``calls`` calls."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="taskcpu-") as out:
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out",
             sys.executable, "-c", CHILD, kind, str(calls), url],
            env=env, cwd=out, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{kind}: the child failed:\n{run.stderr[-2000:]}")
        match = re.search(r"^totals: (\d+)", Path(out, "cg.out").read_text(), re.M)
        if match is None:
            raise SystemExit(f"{kind}: callgrind wrote no totals")
        return int(match.group(1))


def per_task(kind: str, calls: int, url: str, tree: Optional[Path]) -> float:
    return (instructions(kind, calls, url, tree) - instructions(kind, 0, url, tree)) / calls


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.taskcpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--tree", type=Path, action="append", default=[],
                        help="another checkout to measure beside this one (repeatable)")
    parser.add_argument("--peers", action="store_true",
                        help="celery-singleton's and celery-once's worker side too "
                             "(the bench extra)")
    args = parser.parse_args(argv)
    rows = [("plain Celery", "plain", None), ("ours (this checkout)", "ours", None)]
    rows += [(f"ours ({tree})", "ours", tree.resolve()) for tree in args.tree]
    if args.peers:
        rows += [(f"{peer} (worker side)", peer, None)
                 for peer in ("celery-singleton", "celery-once")]
    with RedisServer() as server:
        results = [(label, per_task(kind, args.tasks, server.url(0), tree))
                   for label, kind, tree in rows]
    plain = results[0][1]
    print(f"{args.tasks} calls through the worker's tracer; instructions per task "
          "in the task's process")
    for label, value in results:
        extra = "" if label == "plain Celery" else f"  lock +{value - plain:,.0f}"
        print(f"  {label:<32} {value:>9,.0f}{extra}")


if __name__ == "__main__":
    main()
