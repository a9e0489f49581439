"""Permission checks: what an ACL user must be allowed for the scripts, the
client and publishing, the minimal rule that grants exactly that
(:func:`acl_rule`), and naming the command a user is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import socket
import uuid
from typing import Any, Optional, Sequence

import redis
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)

from ..config import SingletonConfig
from ..engine import shapes
from ..engine.calls import (
    SCRIPTS,
    acquire_call,
    acquire_slots_call,
    enqueue_call,
    fence_call,
    handoff_call,
    reclaim_call,
    release_call,
    renew_call,
    unqueue_call,
)
from ..engine.request import Lease, Request
from ..engine.scripts import PRELUDE, Script, read_source
from ..keys import LockKeys
from .findings import ERROR, OK, WARNING, Finding, command, db_of, server_text, user_of

logger = logging.getLogger("celery_singleton_lock")

#: what the library sends outside its scripts: the scripts by SHA, loading them
#: after a restart, reading an owner record, and redis-py's health check
CLIENT_COMMANDS = ("evalsha", "script|load", "get", "ping")
#: what publishing runs (held locks for ``celery inspect`` and Flower,
#: counters for the metrics) and reading them back: without them the
#: locks work, those stay empty
PUBLISH_COMMANDS = ("expire", "hdel", "hgetall", "hincrby", "hincrbyfloat", "hset")

_CALL = re.compile(r"redis\.call\(\s*'([A-Za-z]+)'")
_NAMED_COMMAND = re.compile(r"run the '([^']+)' command")



_FUNCTION = re.compile(r"^local function (\w+)\(", re.MULTILINE)


def script_commands(script: Script) -> tuple[str, ...]:
    """The commands a script calls, read from its source (lower case): those
    of its own lines, and of the prelude's helpers it calls (each helper runs
    from its ``local function`` line to the next one), not of every helper."""
    prelude = read_source(PRELUDE)
    body = script.source[len(prelude):] if script.source.startswith(prelude) else script.source
    starts = list(_FUNCTION.finditer(prelude))
    helpers = {m.group(1): prelude[m.start():(starts[i + 1].start() if i + 1 < len(starts)
                                               else len(prelude))]
               for i, m in enumerate(starts)}
    texts, seen, todo = [body], set(), [body]
    while todo:
        text = todo.pop()
        for name, helper in helpers.items():
            if name not in seen and re.search(rf"\b{name}\(", text):
                seen.add(name)
                texts.append(helper)
                todo.append(helper)
    return tuple(sorted({name.lower() for text in texts for name in _CALL.findall(text)}))


#: what the acquire scripts call only for a task with ``singleton_rate``: not
#: in the rule unless asked for (``rate``), so a rule granted before stays whole
RATE_COMMANDS = ("zadd", "zcard", "zrange", "zremrangebyscore", "zscore")


def required_commands(db: int = 0, rate: bool = False) -> tuple[str, ...]:
    """Every command a worker's ACL user needs; SELECT only off database 0;
    ``rate``: a task of the app has ``singleton_rate``."""
    names = set(CLIENT_COMMANDS)
    for script in SCRIPTS.values():
        names.update(script_commands(script))
    if not rate:
        names.difference_update(RATE_COMMANDS)
    if db:
        names.add("select")
    return tuple(sorted(names))


def acl_rule(prefix: str, db: int = 0, publish: bool = True, rate: bool = False) -> str:
    """The minimal ACL rule (after ``ACL SETUSER <user> on >password``);
    ``publish=False`` leaves out what only the statistics need; ``rate``
    adds what ``singleton_rate`` needs."""
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
    names = set(required_commands(db, rate)) | (set(PUBLISH_COMMANDS) if publish else set())
    commands = " ".join(f"+{name}" for name in sorted(names))
    return f"resetkeys ~{pattern}* resetchannels -@all {commands}"


def noperm_command(client: redis.Redis, config: SingletonConfig,
                   exc: NoPermissionError, rate: bool = False) -> Finding:
    text = server_text(exc)
    named = _NAMED_COMMAND.search(text)
    what = f"command {named.group(1)!r}" if named else "a command"
    return Finding(
        ERROR, "noperm",
        f"ACL user {user_of(client)!r} may not run {what}: {text}",
        f"grant it: ACL SETUSER {user_of(client)} "
        f"{acl_rule(config.key_prefix, db_of(client), rate=rate)}",
    )


def _probe_calls(keys: LockKeys, other: LockKeys, task_id: str, exec_id: str,
                 rated: Optional[LockKeys] = None) -> list[tuple[str, list[str], list[Any]]]:
    """One harmless call of every script on a fresh random key under our prefix;
    whatever they write expires within seconds. Then, on a second key, a send
    that replaces a queued one and that one's start (``"replace"``); on a
    third (``rated``), a start under ``singleton_rate`` and one refused by it."""
    ask = Request(task_id, exec_id, Lease(5.0), socket.gethostname(),
                  task_name="celery_singleton_lock.checks", scope="queue_and_run")
    again = ask._replace(task_id=exec_id, scope="run")
    rate_probes: list[tuple[str, list[str], list[Any]]] = [] if rated is None else [
        ("acquire", *acquire_call(rated, ask._replace(scope="run", done=False, rate=(1, 5000)),
                                  1000, keep_ms=1000)),
        ("release", *release_call(rated, exec_id, task_id, False, False, 0, 1000)),
        ("acquire", *acquire_call(rated, again._replace(done=False, rate=(1, 5000)), 1000,
                                  keep_ms=1000)),
    ]
    return [
        ("enqueue", *enqueue_call(keys, task_id, "queue_and_run", 5000)),
        ("acquire", *acquire_call(keys, ask, 1000, keep_ms=1000)),
        ("renew", *renew_call([(keys.lock, exec_id, 5000)], 1000)),
        # the heartbeat's write-back and Redlock's counter raise, on the lock
        # this probe holds: both only renew it and leave its token as it is
        ("reclaim", *reclaim_call(keys, ask, 1, 1000, keep_ms=1000)),
        ("fence", *fence_call(keys, exec_id, 1, 1000)),
        ("handoff", *handoff_call(keys, exec_id, 1, 5000)),
        ("release", *release_call(keys, exec_id, task_id, True, True, 1000, 1000)),
        # singleton_limit's grant (another task id: the one above finished),
        # freed at once without a finish marker
        ("acquire_slots", *acquire_slots_call(keys, again._replace(slots=2), 1000,
                                              keep_ms=1000)),
        ("release", *release_call(keys, exec_id, exec_id, False, False, 0, 1000)),
        ("unqueue", *unqueue_call(keys, task_id)),
        ("enqueue", *enqueue_call(other, task_id, "queue", 5000, replace=(1000, 2000))),
        ("enqueue", *enqueue_call(other, exec_id, "queue", 5000, replace=(1000, 2000))),
        ("acquire", *acquire_call(other, ask._replace(scope="queue", replace=True), 1000,
                                  keep_ms=1000)),
        *rate_probes,
    ]


#: one harmless call of each command a script may use, to find the one an ACL
#: denies (inside a script Redis 7.0 does not name it); order: reads first
_COMMAND_PROBES: dict[str, str] = {
    "time": "return redis.call('TIME')",
    "get": "return redis.call('GET', KEYS[1])",
    "pttl": "return redis.call('PTTL', KEYS[1])",
    "hget": "return redis.call('HGET', KEYS[1], 'x')",
    "hgetall": "return redis.call('HGETALL', KEYS[1])",
    "zscore": "return redis.call('ZSCORE', KEYS[1], 'x')",
    "zcard": "return redis.call('ZCARD', KEYS[1])",
    "zrange": "return redis.call('ZRANGE', KEYS[1], 0, 0)",
    "zremrangebyscore": "return redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', 0)",
    "pexpire": "return redis.call('PEXPIRE', KEYS[1], 1000)",
    "del": "return redis.call('DEL', KEYS[1])",
    "set": "return redis.call('SET', KEYS[1], '1', 'PX', 1000)",
    "hset": "return redis.call('HSET', KEYS[1] .. ':h', 'x', '1')",
    # XX: only updates a member already there, so nothing is written
    "zadd": "return redis.call('ZADD', KEYS[1] .. ':z', 'XX', 1, 'x')",
}


def denied_inside(exc: ResponseError) -> bool:
    """A script stopped by the ACL at a command it calls: Redis 7 says it
    "can't run this command", Valkey says "ACL failure in script"."""
    text = str(exc)
    return "can't run this command" in text or "ACL failure in script" in text


def _denied_in_scripts(client: redis.Redis, prefix: str, commands: Sequence[str]) -> list[str]:
    """Which of ``commands`` the user may not call from a script."""
    key = f"{prefix}{{{uuid.uuid4().hex}}}:probe"
    denied: list[str] = []
    for name in [n for n in _COMMAND_PROBES if n in commands]:
        try:
            sha = command(client, "SCRIPT", "LOAD", _COMMAND_PROBES[name])
            command(client, "EVALSHA", sha, 1, key)
        except ResponseError as exc:
            if denied_inside(exc) or isinstance(exc, NoPermissionError):
                denied.append(name)
    return denied


def _acl_log(client: redis.Redis) -> Optional[list[str]]:
    """Commands and keys the ACL log says our user was just denied, or None
    when the log may not be read (the restricted user usually may not)."""
    try:
        entries = command(client, "ACL", "LOG", "20")
    except ResponseError:
        return None
    user = user_of(client)
    out: list[str] = []
    for entry in shapes.entries(entries):
        if shapes.text(entry.get("username")) != user:
            continue
        if float(shapes.text(entry.get("age-seconds") or 0)) > 60:
            continue
        what = f"{shapes.text(entry.get('reason'))} {shapes.text(entry.get('object'))}"
        if what not in out:
            out.append(what)
    return out


def scripts_check(client: redis.Redis, config: SingletonConfig,
                  rate: bool = False) -> list[Finding]:
    """Every script a worker calls, run once as the lock user (``rate``: the
    acquire under ``singleton_rate`` too)."""
    keys = LockKeys(config.key_prefix, uuid.uuid4().hex)
    other = LockKeys(config.key_prefix, uuid.uuid4().hex)
    rated = LockKeys(config.key_prefix, uuid.uuid4().hex)
    task_id = f"checks-{uuid.uuid4().hex}"
    exec_id = uuid.uuid4().hex
    user = user_of(client)
    rule = f"ACL SETUSER {user} {acl_rule(config.key_prefix, db_of(client), rate=rate)}"
    findings: list[Finding] = []
    command_denied: list[str] = []
    probes = _probe_calls(keys, other, task_id, exec_id, rated if rate else None)
    for name, keys_, args in probes:
        script = SCRIPTS[name]
        try:
            sha = command(client, "SCRIPT", "LOAD", script.source)
            if isinstance(sha, dict) and set(sha.values()) == {script.sha}:
                sha = script.sha  # a Cluster: loaded on every primary
            if sha != script.sha:
                findings.append(Finding(ERROR, "script", f"script {name} loaded as {sha}, "
                                        f"expected {script.sha}", "report this as a bug"))
            command(client, "EVALSHA", script.sha, len(keys_), *keys_, *args)
        except NoPermissionError as exc:
            text = server_text(exc)
            if "key" in text:  # Redis: "...one of the keys...", Valkey: "...access a key"
                return [*findings, Finding(
                    ERROR, "noperm",
                    f"ACL user {user!r} may not access keys under the prefix "
                    f"{config.key_prefix!r} (script {name}): {text}",
                    f"allow the key pattern: {rule}")]
            return [*findings, noperm_command(client, config, exc, rate)]
        except ReadOnlyError:
            return [*findings, readonly()]
        except ResponseError as exc:
            # redis-py 4.6 and later raise OutOfMemoryError, 4.5 a ResponseError
            if type(exc).__name__ == "OutOfMemoryError" or "maxmemory" in str(exc):
                return [*findings, Finding(
                    ERROR, "oom", f"the lock Redis refuses writes: {server_text(exc)}",
                    "give it memory (maxmemory) or move the locks to a Redis of their own")]
            if "READONLY" in str(exc):  # Redis 6.2: a script error wrapping it
                return [*findings, readonly()]
            if denied_inside(exc):
                command_denied.append(name)
                continue
            findings.append(Finding(ERROR, "script", f"script {name} failed: {server_text(exc)}",
                                    "check that the server supports Lua scripting (EVALSHA)"))
    # nothing of the probe stays: the grant's fencing counter would live the
    # lease and singleton_fence_ttl (acquire.lua), the finish and done markers
    # a second; the replace probe's send-time key and superseded ids five
    # seconds (one slot per DEL: a Cluster)
    with contextlib.suppress(redis.RedisError):
        command(client, "DEL", keys.fence, keys.fin, keys.done)
    with contextlib.suppress(redis.RedisError):
        command(client, "DEL", other.queued, other.replaced)
    with contextlib.suppress(redis.RedisError):
        command(client, "DEL", rated.fence, rated.fin, rated.rate)
    if command_denied:
        wanted = sorted({c for n in command_denied for c in script_commands(SCRIPTS[n])
                         if rate or c not in RATE_COMMANDS})
        denied = _denied_in_scripts(client, config.key_prefix, wanted)
        logged = _acl_log(client)
        named = ", ".join(denied) if denied else "a command they call"
        seen = (f"; ACL LOG: {', '.join(logged)}" if logged else
                "" if logged is not None else "; ACL LOG may not be read by this user")
        findings.append(Finding(
            ERROR, "noperm",
            f"ACL user {user!r} may not run {named} inside scripts "
            f"(scripts {', '.join(command_denied)} fail: NOPERM){seen}",
            f"grant {' '.join('+' + c for c in denied) or 'the commands'}; "
            f"the full minimal rule: {rule}"))
        return findings
    try:
        command(client, "GET", keys.lock)
    except NoPermissionError as exc:
        return [*findings, noperm_command(client, config, exc)]
    if not findings:
        ran = list(dict.fromkeys(n for n, *_ in probes))  # a script probed twice, named once
        findings.append(Finding(OK, "scripts", f"the {len(ran)} scripts a worker calls "
                                               f"({', '.join(ran)}) load and "
                                               f"run as user {user!r}"))
    return findings


def readonly() -> Finding:
    return Finding(ERROR, "readonly", "the lock Redis is a read-only replica: no lock can be "
                   "taken", "point singleton_redis_url at the primary")


def publishing_check(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    """The statistics' commands, each once on a throwaway key under the prefix."""
    key = f"{config.key_prefix}{{{uuid.uuid4().hex}}}:probe"
    denied: list[str] = []
    try:
        for name, args in (("hincrby", (key, "n", 0)), ("expire", (key, 5)),
                           ("hincrbyfloat", (key, "x", 0)), ("hset", (key, "h", "1")),
                           ("hdel", (key, "h")), ("hgetall", (key,))):
            try:
                command(client, name.upper(), *args)
            except NoPermissionError:
                denied.append(name)
            except ResponseError:  # read-only, out of memory: the scripts' check says it
                return []
    finally:
        with contextlib.suppress(redis.RedisError):
            command(client, "DEL", key)
    if not denied:
        return []
    user = user_of(client)
    return [Finding(
        WARNING, "publish",
        f"ACL user {user!r} may not run {', '.join(denied)}: locks work, but the held "
        "locks and counters are not published (celery inspect stats, Flower, metrics)",
        f"grant {' '.join('+' + c for c in denied)}; the full rule: ACL SETUSER {user} "
        f"{acl_rule(config.key_prefix, db_of(client))}")]


# -- beat --------------------------------------------------------------------------

#: what a beat sends beyond claiming ticks (``SET NX PX``, then ``GET``) and
#: reading a running task's owner record (``GET``), by the overlap mode of its
#: SingletonTask entries (:mod:`..beat.overlap`): a waiting tick is looked for with
#: ``EXISTS``, taken with ``GETDEL``, and ``buffer_all``'s queue is kept by two
#: small scripts called by SHA (``EVALSHA``, ``SCRIPT LOAD``: in the worker's
#: rule too) that call the sorted-set commands
BEAT_COMMANDS: dict[str, tuple[str, ...]] = {
    "buffer_one": ("exists", "getdel"),
    "cancel_other": ("exists", "getdel"),
    "terminate_other": ("exists", "getdel"),
    "buffer_all": ("evalsha", "exists", "script|load", "zadd", "zcard", "zpopmin", "zscore"),
}

#: one harmless call of each, on a fresh key under the prefix; ``EVALSHA`` of
#: a script no server has (NOSCRIPT: allowed to run it)
_BEAT_PROBES: dict[str, tuple[Any, ...]] = {
    "set": ("SET", "{key}", "1", "NX", "PX", "1000"),
    "get": ("GET", "{key}"),
    "exists": ("EXISTS", "{key}"),
    "getdel": ("GETDEL", "{key}"),
    "evalsha": ("EVALSHA", "0" * 40, "0"),
    "script|load": ("SCRIPT", "LOAD", "return 1"),
}

#: the commands buffer_all's scripts call, each tried inside a script of its
#: own, loaded and called by SHA as the beat calls them
_BEAT_SCRIPT_PROBES: dict[str, str] = {
    "zadd": "return redis.call('ZADD', KEYS[1], 1, 'x')",
    "zcard": "return redis.call('ZCARD', KEYS[1])",
    "zscore": "return redis.call('ZSCORE', KEYS[1], 'x')",
    "zpopmin": "return redis.call('ZPOPMIN', KEYS[1])",
}


def beat_commands(modes: Sequence[str]) -> tuple[str, ...]:
    """The commands a beat whose SingletonTask entries use these overlap modes sends."""
    names = {"get", "set"}
    for mode in modes:
        names.update(BEAT_COMMANDS.get(mode, ()))
    return tuple(sorted(names))


def beat_denied(client: redis.Redis, prefix: str, modes: Sequence[str]) -> list[str]:
    """The commands of :func:`beat_commands` the client's ACL user may not run,
    each tried once on a key of its own that is gone when this returns (raises
    ``redis.RedisError`` when Redis cannot answer)."""
    token = uuid.uuid4().hex
    # one hash tag: in a Cluster both keys live on one node, and one DEL frees them
    keys = {"key": f"{prefix}probe:{{{token}}}", "zkey": f"{prefix}probe:{{{token}}}:z"}
    names = beat_commands(modes)
    denied: list[str] = []
    try:
        for name in names:
            if name in _BEAT_SCRIPT_PROBES:
                if "evalsha" in denied or "script|load" in denied:
                    continue  # no script can start: those two are named
                probe: tuple[Any, ...] = ("SCRIPT", "LOAD", _BEAT_SCRIPT_PROBES[name])
            else:
                probe = tuple(arg.format(**keys) for arg in _BEAT_PROBES[name])
            try:
                command(client, *probe)  # a Cluster client answers SCRIPT LOAD per node
                if name in _BEAT_SCRIPT_PROBES:
                    sha = hashlib.sha1(_BEAT_SCRIPT_PROBES[name].encode()).hexdigest()
                    command(client, "EVALSHA", sha, 1, keys["zkey"])
            except NoPermissionError:
                denied.append(name)
            except NoScriptError:
                if name != "evalsha":
                    raise
            except ResponseError as exc:
                if not denied_inside(exc):
                    raise
                denied.append(name)
    finally:
        with contextlib.suppress(redis.RedisError):
            command(client, "DEL", *keys.values())
    return denied


def beat_refusal(client: redis.Redis, denied: Sequence[str], modes: Sequence[str]
                 ) -> tuple[str, str]:
    """What a beat (or doctor) says of :func:`beat_denied`'s answer: the message
    and the grant."""
    user = user_of(client)
    needs = f"entries with singleton_overlap {', '.join(modes)}" if modes else "claiming ticks"
    return (f"the lock Redis user {user!r} may not run {', '.join(denied)}, which a beat "
            f"needs ({needs})",
            f"grant it: ACL SETUSER {user} {' '.join('+' + name for name in denied)} "
            "(docs/redis-acl.md, Beat)")
