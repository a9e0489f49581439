"""What each workload of :mod:`benchmarks.lockcpu` sends the lock Redis per
"task": ours, the floor, the bounds (redis-py's ``Lock``, bare scripts, bare
scripts with a fencing token), a skipped duplicate and one bare ``GET``,
ours as Redis Functions and an owner record that a plain ``HDEL`` frees. Each
returns the call that runs its tasks, made ready (keys drawn, scripts loaded)
so that only the tasks are measured.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import redis

from celery_singleton_lock.config import SingletonConfig
from celery_singleton_lock.engine.calls import SCRIPTS, acquire_call, record_rest, release_call
from celery_singleton_lock.engine.request import Lease, Request
from celery_singleton_lock.engine.scripts import pack
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys

from .lockserver import Server

LEASE_MS = 30_000
#: how long a key's fencing counter outlives its lock: singleton_fence_ttl's default
KEEP_MS = int(SingletonConfig.defaults("redis://").fence_ttl * 1000)

#: redis-py's connection, whose methods carry no annotations
Connection: Any = redis.Connection


def floor_workload(server: Server, tasks: int) -> Callable[[], None]:
    """SET NX PX before the task, DEL after: the least a lock can send."""
    conn = Connection(port=server.port)
    conn.connect()
    names = [f"singleton:{{{uuid.uuid4().hex}}}:lock" for _ in range(tasks)]

    def run() -> None:
        for name in names:
            conn.send_packed_command(
                [pack(["SET", name, "w1:1234:abcdef", "NX", "PX", LEASE_MS])], check_health=False)
            conn.read_response()
            conn.send_packed_command([pack(["DEL", name])], check_health=False)
            conn.read_response()
    return run


#: the least a lock written as scripts can do: take with ``SET NX PX``, free
#: only when the value is still ours (compare-and-delete)
BARE_TAKE = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0"
BARE_FREE = ("if redis.call('GET', KEYS[1]) == ARGV[1] then "
             "return redis.call('DEL', KEYS[1]) end return 0")
#: the bare take plus a fencing token that never goes down: the key's counter
#: + 1, floored at the server clock (as ours), kept after the lock is freed
FENCED_TAKE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local t = redis.call('TIME')
local us = t[2]
local now = t[1] .. string.sub('00000', #us) .. us
local token = now
local last = redis.call('GET', KEYS[2])
if last and (#last > #now or (#last == #now and last >= now)) then
  token = string.format('%.0f', tonumber(last) + 1)
end
redis.call('SET', KEYS[2], token, 'PX', '330000')
return token
"""


def redispy_workload(server: Server, tasks: int) -> Callable[[], None]:
    """redis-py's ``Lock``: ``SET NX PX`` to take it, a compare-and-delete
    script to free it (the cheapest lock that frees only its own key)."""
    client = redis.Redis(port=server.port)
    locks = [client.lock(f"singleton:{{{uuid.uuid4().hex}}}:lock", timeout=LEASE_MS / 1000)
             for _ in range(tasks)]
    warm = client.lock("singleton:{warm}:lock", timeout=LEASE_MS / 1000)
    warm.acquire(blocking=False)
    warm.release()

    def run() -> None:
        for lock in locks:
            if not lock.acquire(blocking=False):
                raise RuntimeError("redis-py's Lock was refused a free key")
            lock.release()
    return run


def bare_scripts_workload(server: Server, tasks: int, fenced: bool = False
                          ) -> Callable[[], None]:
    """Both steps as scripts doing nothing more than the floor and the owner
    check: the least any lock pays whose acquire and release are scripts.
    ``fenced``: the acquire also hands out a fencing token."""
    take = server.client.script_load(FENCED_TAKE if fenced else BARE_TAKE)
    free = server.client.script_load(BARE_FREE)
    conn = Connection(port=server.port)
    conn.connect()
    names = [f"singleton:{{{uuid.uuid4().hex}}}:" for _ in range(tasks)]

    def run() -> None:
        for base in names:
            name = base + "lock"
            keys = [2, name, base + "fence"] if fenced else [1, name]
            conn.send_packed_command(
                [pack(["EVALSHA", take, *keys, "w1:1234:abcdef", LEASE_MS])],
                check_health=False)
            if not conn.read_response():
                raise RuntimeError("the bare script lock was refused a free key")
            conn.send_packed_command([pack(["EVALSHA", free, 1, name, "w1:1234:abcdef"])],
                                     check_health=False)
            conn.read_response()
    return run


def _engine(server: Server, native: str = "auto") -> LockEngine:
    config = SingletonConfig.defaults(f"redis://127.0.0.1:{server.port}/0", native=native)
    return LockEngine.from_config(config)


def ours_workload(server: Server, tasks: int, native: str = "auto") -> Callable[[], None]:
    """The engine's acquire and release, as the worker calls them for a task
    with the default settings (no done window): by default as the library
    chooses (native commands on a server that has them, :mod:`celery_singleton_lock.
    engine.native`), ``native="off"`` the scripts on any server."""
    engine = _engine(server, native)
    calls = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]
    engine.acquire(calls[0][0], Request(task_id="warm", exec_id="warm",
                                        lease=Lease.of_ms(LEASE_MS), hostname="celery@bench",
                                        retries=0, task_name="bench.trivial",
                                        done=False))
    engine.release(calls[0][0], "warm", "warm")

    def run() -> None:
        for keys, task_id, exec_id in calls:
            engine.acquire(keys, Request(task_id=task_id, exec_id=exec_id,
                                         lease=Lease.of_ms(LEASE_MS), hostname="celery@bench",
                                         retries=0, task_name="bench.trivial",
                                         done=False))
            engine.release(keys, exec_id, task_id)
    return run


def fcall_workload(server: Server, tasks: int) -> Callable[[], None]:
    """Ours' acquire.lua and release.lua unchanged, each the body of a Redis
    Function (``FUNCTION LOAD``, Redis 7.0+) called with ``FCALL`` instead of
    ``EVALSHA``, with the same KEYS and ARGV: what Functions would save."""
    library = "#!lua name=singleton_bench\n" + "".join(
        f"redis.register_function('singleton_{name}', function(KEYS, ARGV)\n"
        f"{SCRIPTS[name].source}\nend)\n" for name in ("acquire", "release"))
    server.client.function_load(library, replace=True)
    fin_ms = int(SingletonConfig.defaults("redis://").finished_ttl * 1000)  # as the engine's
    conn = Connection(port=server.port)
    conn.connect()
    calls = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]

    def fcall(name: str, keys: list[str], argv: list[Any]) -> Any:
        conn.send_packed_command([pack(["FCALL", f"singleton_{name}", len(keys), *keys,
                                        *argv])], check_health=False)
        return conn.read_response()

    def run() -> None:
        for keys, task_id, exec_id in calls:
            request = Request(task_id, exec_id, Lease.of_ms(LEASE_MS), "celery@bench",
                              task_name="bench.trivial", done=False)
            token = fcall("acquire", *acquire_call(keys, request, fin_ms, keep_ms=KEEP_MS))
            if not (isinstance(token, bytes) and token.isdigit()):
                raise RuntimeError(f"the FCALL acquire was refused a free key: {token!r}")
            fcall("release", *release_call(keys, exec_id, task_id, True, False, 0, fin_ms))
    return run


def skip_workload(server: Server, tasks: int) -> Callable[[], None]:
    """Acquires that find the key held by another task: the skipped duplicates
    (of a task with the default settings, as in :func:`ours_workload`)."""
    engine = _engine(server)
    keys = LockKeys("singleton:", uuid.uuid4().hex)
    ids = [uuid.uuid4().hex for _ in range(tasks)]

    def run() -> None:
        engine.acquire(keys, Request(task_id="holder", exec_id="holder:1",
                                     lease=Lease.of_ms(LEASE_MS * 10), hostname="celery@bench",
                                     retries=0,
                                     task_name="bench.trivial"))
        for task_id in ids:
            engine.acquire(keys, Request(task_id=task_id, exec_id=task_id,
                                         lease=Lease.of_ms(LEASE_MS), hostname="celery@bench",
                                         retries=0, task_name="bench.trivial",
                                         done=False))
    return run


#: a grant whose owner record is a field named by the execution id in a hash:
#: held while any field but the finish marker's is there (its expiry not
#: checked: a bound), a token as ours, the record as ours; ``HDEL`` of one's
#: own field frees it, and can free nothing else
HASH_TAKE = r"""
local owner = redis.call('HGETALL', KEYS[1])
if #owner > 0 then
  for i = 1, #owner, 2 do
    if owner[i] == 'fin' and owner[i + 1] == ARGV[1] then return {3, ARGV[1]} end
  end
  if #owner > 2 or owner[1] ~= 'fin' then return {0, owner[2]} end
end
local t = redis.call('TIME')
local us = t[2]
local now = t[1] .. string.sub('00000', #us) .. us
local token = now
local last = redis.call('SET', KEYS[2], now, 'PX', '330000', 'GET')
if last and (#last > #now or (#last == #now and last >= now)) then
  token = string.format('%.0f', tonumber(last) + 1)
  redis.call('SET', KEYS[2], token, 'PX', '330000')
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[2] .. '\n\n\n' .. token .. '\n' .. now .. '\n' .. ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return token
"""


def hashfield_workload(server: Server, tasks: int) -> Callable[[], None]:
    """The grant as :data:`HASH_TAKE` (ours' arguments, two keys: the finish
    marker is a field of the owner's hash), the release a plain ``HDEL``."""
    take = server.client.script_load(HASH_TAKE)
    conn = Connection(port=server.port)
    conn.connect()
    calls = [(f"singleton:{{{uuid.uuid4().hex}}}:", uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]
    rest = [record_rest(Request(task_id, exec_id, Lease.of_ms(LEASE_MS), "celery@bench",
                                task_name="bench.trivial"), 86_400_000)
            for _, task_id, exec_id in calls]

    def run() -> None:
        for (base, task_id, exec_id), fields in zip(calls, rest):
            conn.send_packed_command([pack(["EVALSHA", take, 2, base + "lock", base + "fence",
                                            task_id, exec_id, LEASE_MS, fields])],
                                     check_health=False)
            token = conn.read_response()
            if not (isinstance(token, bytes) and token.isdigit()):
                raise RuntimeError(f"the hash-field grant was refused a free key: {token!r}")
            conn.send_packed_command([pack(["HDEL", base + "lock", exec_id])],
                                     check_health=False)
            if conn.read_response() != 1:
                raise RuntimeError("the HDEL release found no field of its own")
    return run


def get_workload(server: Server, tasks: int) -> Callable[[], None]:
    """One bare GET per task: a skip's floor."""
    conn = Connection(port=server.port)
    conn.connect()
    server.client.set("singleton:{held}:lock", "x")

    def run() -> None:
        for _ in range(tasks):
            conn.send_packed_command([pack(["GET", "singleton:{held}:lock"])], check_health=False)
            conn.read_response()
    return run


def delifeq_workload(server: Server, tasks: int) -> Callable[[], None]:
    """Ours' ``acquire.lua`` unchanged, the release a plain ``DELIFEQ`` of the
    owner record it wrote (Valkey 9.0+): what a native compare-and-delete
    would save on a server that has one. Each key is new, so the token is the
    server clock the record also holds, and the record is known here; the
    finish marker of a copy seen meanwhile, which ``release.lua`` writes, is
    not (a bound)."""
    try:
        client: Any = server.client  # redis-py's execute_command carries no annotations
        client.execute_command("DELIFEQ", "singleton:{probe}:lock", "x")
    except redis.ResponseError:
        raise SystemExit(f"{server.binary} has no DELIFEQ (Valkey 9.0+): run with "
                         "SINGLETON_TEST_REDIS_SERVER naming a valkey-server") from None
    fin_ms = int(SingletonConfig.defaults("redis://").finished_ttl * 1000)  # as the engine's
    conn = Connection(port=server.port)
    conn.connect()
    take = server.client.script_load(SCRIPTS["acquire"].source)
    calls = [(LockKeys("singleton:", uuid.uuid4().hex), uuid.uuid4().hex, f"w1:{i}")
             for i in range(tasks)]

    def run() -> None:
        for keys, task_id, exec_id in calls:
            names, argv = acquire_call(keys, Request(task_id=task_id, exec_id=exec_id,
                                                     lease=Lease.of_ms(LEASE_MS),
                                                     hostname="celery@bench", retries=0,
                                                     task_name="bench.trivial", scope="run",
                                                     done=False), fin_ms, keep_ms=KEEP_MS)
            conn.send_packed_command([pack(["EVALSHA", take, len(names), *names, *argv])],
                                     check_health=False)
            token = conn.read_response()
            if not (isinstance(token, bytes) and token.isdigit()):
                raise RuntimeError(f"ours' acquire was refused a free key: {token!r}")
            now = token.decode()  # the token is the clock the record holds
            record = f"{exec_id}\n\n\n{now}\n{now}\n{argv[3]}"
            conn.send_packed_command([pack(["DELIFEQ", keys.lock, record])],
                                     check_health=False)
            if conn.read_response() != 1:
                raise RuntimeError("DELIFEQ did not free the record the grant wrote")
    return run


WORKLOADS: dict[str, Callable[[Server, int], Callable[[], None]]] = {
    "floor": floor_workload, "ours": ours_workload, "skip": skip_workload, "get": get_workload,
    "redispy": redispy_workload, "scripts": bare_scripts_workload,
    "fenced": lambda server, tasks: bare_scripts_workload(server, tasks, fenced=True),
    "fcall": fcall_workload, "hashfield": hashfield_workload, "delifeq": delifeq_workload,
    "ours_scripts": lambda server, tasks: ours_workload(server, tasks, native="off"),
}
