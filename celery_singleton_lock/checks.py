"""Checks of the lock Redis: what can make a lock lie, or make every lock call fail.

A lock is only as good as the Redis under it. A wrong password or an ACL user
missing one command turns every singleton task into an endless retry; an
eviction policy that may drop keys lets a duplicate run beside its holder; a
replica or a Redis without persistence forgets grants. Each check returns
:class:`Finding` s saying what was seen and what to do; :func:`startup_check`
turns them into a worker's start-up verdict and ``celery singleton doctor``
prints them.

No Celery import: the checks need only a redis-py client and the settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import redis
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    ReadOnlyError,
    ResponseError,
)

from . import shapes
from .config import SingletonConfig
from .engine import (
    SCRIPTS,
    LockEngine,
    acquire_call,
    enqueue_call,
    handoff_call,
    release_call,
    renew_call,
    unqueue_call,
)
from .exceptions import ConfigurationError
from .keys import LockKeys
from .masking import mask_url
from .redlock import RedlockEngine
from .wire import Script

logger = logging.getLogger("celery_singleton_lock")

ERROR = "error"
WARNING = "warning"
OK = "ok"

#: the oldest server our scripts run on: they read TIME before writing, which
#: needs script effects replication (the default from Redis 5.0)
MIN_VERSION = (5, 0)

#: the host's wall clock (a name of its own, so a test can set it off)
wall_clock = time.time

#: a clock offset above this share of the lease is reported
CLOCK_FRACTION = 0.1

#: what the library sends outside its scripts: the scripts by SHA, loading them
#: after a restart, reading an owner record, and redis-py's health check
CLIENT_COMMANDS = ("evalsha", "script|load", "get", "ping")
#: what publishing runs (held locks for ``celery inspect`` and Flower,
#: counters for the metrics) and reading them back: without them the
#: locks work, those stay empty
PUBLISH_COMMANDS = ("expire", "hdel", "hgetall", "hincrby", "hincrbyfloat", "hset")

#: eviction policies that never evict a key; every other one may evict ours
#: (every key we write carries a TTL, so volatile-* picks them too)
SAFE_EVICTION = ("noeviction",)

_CALL = re.compile(r"redis\.call\(\s*'([A-Za-z]+)'")
_NAMED_COMMAND = re.compile(r"run the '([^']+)' command")


@dataclass(frozen=True)
class Finding:
    """One thing a check saw: ``level`` is error, warning or ok; ``action`` says
    what to do about it (empty when nothing is to be done)."""

    level: str
    code: str
    message: str
    action: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def script_commands(script: Script) -> tuple[str, ...]:
    """The commands a script calls, read from its source (lower case)."""
    return tuple(sorted({name.lower() for name in _CALL.findall(script.source)}))


def required_commands(db: int = 0) -> tuple[str, ...]:
    """Every command a worker's ACL user needs; SELECT only off database 0."""
    names = set(CLIENT_COMMANDS)
    for script in SCRIPTS.values():
        names.update(script_commands(script))
    if db:
        names.add("select")
    return tuple(sorted(names))


def acl_rule(prefix: str, db: int = 0, publish: bool = True) -> str:
    """The minimal ACL rule (after ``ACL SETUSER <user> on >password``);
    ``publish=False`` leaves out what only the statistics need."""
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
    names = set(required_commands(db)) | (set(PUBLISH_COMMANDS) if publish else set())
    commands = " ".join(f"+{name}" for name in sorted(names))
    return f"resetkeys ~{pattern}* resetchannels -@all {commands}"


def _kwargs(client: redis.Redis) -> dict[str, Any]:
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a RedisCluster: the options every node connection gets
        return dict(client.get_connection_kwargs())
    return dict(pool.connection_kwargs)


def _db(client: redis.Redis) -> int:
    return int(_kwargs(client).get("db") or 0)


def _user(client: redis.Redis) -> str:
    return str(_kwargs(client).get("username") or "default")


def _cmd(client: redis.Redis, *args: Any) -> Any:
    """One command, its reply parsed by redis-py (typed for the checks)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _config(client: redis.Redis, name: str) -> Optional[str]:
    """One server setting (CONFIG GET), whatever shape redis-py gives it."""
    return shapes.config_value(_cmd(client, "CONFIG", "GET", name), name)


def _server_text(exc: BaseException) -> str:
    """The server's error text; a password is never in it."""
    return str(exc).strip() or type(exc).__name__


def run_checks(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    """Every check, in the order a reader fixes them: reach, authenticate,
    run the scripts, then what can make a granted lock lie."""
    url = mask_url(config.redis_url)
    findings: list[Finding] = []
    try:
        _cmd(client, "PING")
        findings.append(Finding(OK, "reachable", f"lock Redis at {url} answers as user "
                                                 f"{_user(client)!r}"))
        findings.extend(_version(client))
        findings.extend(_scripts(client, config))
        findings.extend(_publishing(client, config))
        findings.extend(_eviction(client))
        findings.extend(_clock(client, config))
        findings.extend(_persistence(client))
        findings.extend(_replication(client))
    except NoPermissionError as exc:
        # PING, or SELECT on connect: Redis names the command
        return [*findings, _noperm_command(client, config, exc)]
    except AuthenticationError as exc:
        return [Finding(
            ERROR, "auth",
            f"lock Redis at {url} refused the credentials of user {_user(client)!r}: "
            f"{_server_text(exc)}",
            "set the user and password in singleton_redis_url "
            "(redis://user:password@host:port/db) or singleton_redis_options",
        )]
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return [Finding(
            ERROR, "unreachable",
            f"lock Redis at {url} is unreachable: {type(exc).__name__}: {_server_text(exc)}",
            "start Redis or fix the host and port in singleton_redis_url; until it is "
            "back, singleton tasks follow singleton_on_backend_error",
        )]
    return findings


# -- permissions and scripts -------------------------------------------------------

def _noperm_command(client: redis.Redis, config: SingletonConfig,
                    exc: NoPermissionError) -> Finding:
    text = _server_text(exc)
    named = _NAMED_COMMAND.search(text)
    what = f"command {named.group(1)!r}" if named else "a command"
    return Finding(
        ERROR, "noperm",
        f"ACL user {_user(client)!r} may not run {what}: {text}",
        f"grant it: ACL SETUSER {_user(client)} {acl_rule(config.key_prefix, _db(client))}",
    )


def _probe_calls(keys: LockKeys, task_id: str, exec_id: str
                 ) -> list[tuple[str, list[str], list[Any]]]:
    """One harmless call of every script on a fresh random key under our prefix;
    whatever they write expires within seconds."""
    return [
        ("enqueue", *enqueue_call(keys, task_id, "queue_and_run", 5000)),
        ("acquire", *acquire_call(keys, task_id, exec_id, 5000, socket.gethostname(), 0,
                                  "celery_singleton_lock.checks", "queue_and_run", 1000)),
        ("renew", *renew_call([(keys.lock, exec_id, 5000)])),
        ("handoff", *handoff_call(keys, exec_id, 1, 5000)),
        ("release", *release_call(keys, exec_id, task_id, True, True, 1.0, 1000)),
        ("unqueue", *unqueue_call(keys, task_id)),
    ]


#: one harmless call of each command a script may use, to find the one an ACL
#: denies (inside a script Redis 7.0 does not name it); order: reads first
_COMMAND_PROBES: dict[str, str] = {
    "time": "return redis.call('TIME')",
    "get": "return redis.call('GET', KEYS[1])",
    "pexpire": "return redis.call('PEXPIRE', KEYS[1], 1000)",
    "del": "return redis.call('DEL', KEYS[1])",
    "set": "return redis.call('SET', KEYS[1], '1', 'PX', 1000)",
}


def _denied_inside(exc: ResponseError) -> bool:
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
            sha = _cmd(client, "SCRIPT", "LOAD", _COMMAND_PROBES[name])
            _cmd(client, "EVALSHA", sha, 1, key)
        except ResponseError as exc:
            if _denied_inside(exc) or isinstance(exc, NoPermissionError):
                denied.append(name)
    return denied


def _acl_log(client: redis.Redis) -> Optional[list[str]]:
    """Commands and keys the ACL log says our user was just denied, or None
    when the log may not be read (the restricted user usually may not)."""
    try:
        entries = _cmd(client, "ACL", "LOG", "20")
    except ResponseError:
        return None
    user = _user(client)
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


def _scripts(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    keys = LockKeys(config.key_prefix, uuid.uuid4().hex)
    task_id = f"checks-{uuid.uuid4().hex}"
    exec_id = uuid.uuid4().hex
    user = _user(client)
    rule = f"ACL SETUSER {user} {acl_rule(config.key_prefix, _db(client))}"
    findings: list[Finding] = []
    command_denied: list[str] = []
    for name, keys_, args in _probe_calls(keys, task_id, exec_id):
        script = SCRIPTS[name]
        try:
            sha = _cmd(client, "SCRIPT", "LOAD", script.source)
            if isinstance(sha, dict) and set(sha.values()) == {script.sha}:
                sha = script.sha  # a Cluster: loaded on every primary
            if sha != script.sha:
                findings.append(Finding(ERROR, "script", f"script {name} loaded as {sha}, "
                                        f"expected {script.sha}", "report this as a bug"))
            _cmd(client, "EVALSHA", script.sha, len(keys_), *keys_, *args)
        except NoPermissionError as exc:
            text = _server_text(exc)
            if "key" in text:  # Redis: "...one of the keys...", Valkey: "...access a key"
                return [*findings, Finding(
                    ERROR, "noperm",
                    f"ACL user {user!r} may not access keys under the prefix "
                    f"{config.key_prefix!r} (script {name}): {text}",
                    f"allow the key pattern: {rule}")]
            return [*findings, _noperm_command(client, config, exc)]
        except ReadOnlyError:
            return [*findings, _readonly()]
        except ResponseError as exc:
            # redis-py 4.6 and later raise OutOfMemoryError, 4.5 a ResponseError
            if type(exc).__name__ == "OutOfMemoryError" or "maxmemory" in str(exc):
                return [*findings, Finding(
                    ERROR, "oom", f"the lock Redis refuses writes: {_server_text(exc)}",
                    "give it memory (maxmemory) or move the locks to a Redis of their own")]
            if "READONLY" in str(exc):  # Redis 6.2: a script error wrapping it
                return [*findings, _readonly()]
            if _denied_inside(exc):
                command_denied.append(name)
                continue
            findings.append(Finding(ERROR, "script", f"script {name} failed: {_server_text(exc)}",
                                    "check that the server supports Lua scripting (EVALSHA)"))
    # nothing of the probe stays: the grant's fencing counter would live a day
    # (acquire.lua), the finish and done markers a second
    with contextlib.suppress(redis.RedisError):
        _cmd(client, "DEL", keys.fence, keys.fin, keys.done)
    if command_denied:
        wanted = sorted({c for n in command_denied for c in script_commands(SCRIPTS[n])})
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
        _cmd(client, "GET", keys.lock)
    except NoPermissionError as exc:
        return [*findings, _noperm_command(client, config, exc)]
    if not findings:
        findings.append(Finding(OK, "scripts", f"all {len(SCRIPTS)} scripts load and run as "
                                               f"user {user!r}"))
    return findings


def _readonly() -> Finding:
    return Finding(ERROR, "readonly", "the lock Redis is a read-only replica: no lock can be "
                   "taken", "point singleton_redis_url at the primary")


def _publishing(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    """The statistics' commands, each once on a throwaway key under the prefix."""
    key = f"{config.key_prefix}{{{uuid.uuid4().hex}}}:probe"
    denied: list[str] = []
    try:
        for name, args in (("hincrby", (key, "n", 0)), ("expire", (key, 5)),
                           ("hincrbyfloat", (key, "x", 0)), ("hset", (key, "h", "1")),
                           ("hdel", (key, "h")), ("hgetall", (key,))):
            try:
                _cmd(client, name.upper(), *args)
            except NoPermissionError:
                denied.append(name)
            except ResponseError:  # read-only, out of memory: the scripts' check says it
                return []
    finally:
        with contextlib.suppress(redis.RedisError):
            _cmd(client, "DEL", key)
    if not denied:
        return []
    user = _user(client)
    return [Finding(
        WARNING, "publish",
        f"ACL user {user!r} may not run {', '.join(denied)}: locks work, but the held "
        "locks and counters are not published (celery inspect stats, Flower, metrics)",
        f"grant {' '.join('+' + c for c in denied)}; the full rule: ACL SETUSER {user} "
        f"{acl_rule(config.key_prefix, _db(client))}")]


# -- what makes a granted lock lie -------------------------------------------------

def _denied(what: str, command: str, exc: ResponseError) -> Finding:
    return Finding(WARNING, f"{what}-unknown",
                   f"could not read the {what} setting: {_server_text(exc)}",
                   f"check it by hand, or let doctor run as a user allowed {command}")


def _info(client: redis.Redis, section: str) -> dict[str, Any]:
    return shapes.info_dict(_cmd(client, "INFO", section))


def _version(client: redis.Redis) -> list[Finding]:
    try:
        info = _info(client, "server")
    except ResponseError as exc:
        return [_denied("version", "INFO", exc)]
    text = str(info.get("redis_version", "0"))
    server = f"Valkey {info['valkey_version']}" if "valkey_version" in info else f"Redis {text}"
    try:
        version = tuple(int(p) for p in text.split(".")[:2])
    except ValueError:
        version = (0, 0)
    if version < MIN_VERSION:
        return [Finding(ERROR, "version", f"{server}: the scripts need Redis 5.0 or later "
                        "(they read TIME before writing)", "upgrade the lock Redis")]
    return [Finding(OK, "version", server)]


def _eviction(client: redis.Redis) -> list[Finding]:
    try:
        policy = _config(client, "maxmemory-policy") or ""
        maxmemory = int(_config(client, "maxmemory") or 0)
    except ResponseError as exc:
        return [_denied("eviction", "CONFIG GET (maxmemory-policy)", exc)]
    if policy in SAFE_EVICTION:
        return [Finding(OK, "eviction", f"maxmemory-policy {policy}: lock keys are never evicted")]
    why = ("every lock key carries a TTL, so volatile-* policies pick them"
           + (" (volatile-ttl first of all: their TTLs are short)" if policy == "volatile-ttl"
              else "") if policy.startswith("volatile") else "any key may go")
    limit = ("; maxmemory is 0 now, so nothing is evicted until a limit is set"
             if maxmemory == 0 else f"; maxmemory is {maxmemory} bytes")
    return [Finding(
        WARNING, "eviction",
        f"maxmemory-policy {policy} may evict a held lock under memory pressure and let a "
        f"duplicate run beside its holder: {why}{limit}",
        "set maxmemory-policy noeviction on the lock Redis (CONFIG SET and redis.conf), or "
        "keep the locks in a Redis of their own")]


def _clock(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    before = wall_clock()
    seconds, micros = _cmd(client, "TIME")
    after = wall_clock()
    server = int(seconds) + int(micros) / 1e6
    skew = server - (before + after) / 2
    margin = (after - before) / 2
    limit = config.ttl * CLOCK_FRACTION
    if abs(skew) - margin > limit:
        return [Finding(
            WARNING, "clock",
            f"this host's clock is {skew:+.3f} s off the Redis TIME, more than "
            f"{CLOCK_FRACTION:.0%} of the {config.ttl:g} s lease: a clock that far off is not "
            "kept by NTP, its rate may be off too, and lock ages read wrong",
            "run NTP (chrony, systemd-timesyncd) on the workers and on the Redis host")]
    return [Finding(OK, "clock", f"host clock within {abs(skew):.3f} s of the Redis TIME")]


def _persistence(client: redis.Redis) -> list[Finding]:
    try:
        info = _info(client, "persistence")
    except ResponseError as exc:
        return [_denied("persistence", "INFO", exc)]
    if int(info.get("aof_enabled") or 0):
        return [Finding(OK, "persistence", "append-only file on: a restart keeps held locks "
                        "(up to the last fsync)")]
    try:
        save = _config(client, "save") or ""
    except ResponseError:
        save = "?"
    forgets = ("no snapshots either: a restart forgets every held lock" if save == "" else
               "snapshots unknown (CONFIG GET save not permitted): a restart forgets at least "
               "the locks taken since the last snapshot" if save == "?" else
               f"snapshots only ({save}): a restart forgets the locks taken since the last one")
    return [Finding(
        WARNING, "persistence",
        f"no append-only file, {forgets}; a duplicate may then start before the holder "
        "notices (fencing tokens still only go up)",
        "accept it, or set appendonly yes on the lock Redis")]


def _replication(client: redis.Redis) -> list[Finding]:
    try:
        info = _info(client, "replication")
    except ResponseError as exc:
        return [_denied("replication", "INFO", exc)]
    role = str(info.get("role", "master"))
    if role != "master":
        return [Finding(ERROR, "replica", f"the lock Redis is a {role}: locks must be taken "
                        "on the primary", "point singleton_redis_url at the primary")]
    replicas = int(info.get("connected_slaves") or 0)
    if replicas:
        return [Finding(
            WARNING, "replication",
            f"{replicas} replica(s): replication is asynchronous, so after a failover the new "
            "primary may not have a lock just granted, and a duplicate may run",
            "accept the window, or keep the locks on a Redis without failover")]
    return [Finding(OK, "replication", "no replicas")]


def engine_checks(engine: LockEngine) -> list[Finding]:
    """:func:`run_checks` on the engine's Redis; with Redlock, on every master,
    after a summary (code ``redlock``) of which masters answer."""
    if not isinstance(engine, RedlockEngine):
        return run_checks(engine.client, engine.config)
    findings: list[Finding] = []
    answering: list[str] = []
    silent: list[str] = []
    for master in engine.masters:
        config = dataclasses.replace(engine.config, redis_url=f"redis://{master.name}")
        own = run_checks(master.engine.client, config)
        (silent if any(f.code == "unreachable" for f in own) else answering).append(master.name)
        findings.extend(dataclasses.replace(f, message=f"master {master.name}: {f.message}")
                        for f in own)
    total, quorum = len(engine.masters), engine.quorum
    text = (f"Redlock over {total} masters (a majority is {quorum}): {len(answering)} "
            f"answer ({', '.join(answering) or 'none'})")
    if not silent:
        return [Finding(OK, "redlock", text), *findings]
    text += f"; no answer from {', '.join(silent)}"
    if len(answering) >= quorum:
        return [Finding(WARNING, "redlock", text,
                        f"locks work while a majority answers; {len(answering) - quorum + 1} "
                        "more master(s) down would stop them: bring the others back"),
            *findings]
    return [Finding(ERROR, "redlock", text + ": no lock can be granted",
                    "bring masters back until a majority answers; until then singleton "
                    "tasks follow singleton_on_backend_error"), *findings]


# -- worker start-up ---------------------------------------------------------------

def startup_check(engine: LockEngine) -> None:
    """Check the lock Redis when a worker starts.

    A wrong password or a missing permission fails every lock call for as long
    as the worker runs, so it stops the start (ConfigurationError). Redis merely
    down is logged and the start goes on: it may be back in seconds, and until
    then ``singleton_on_backend_error`` decides each task, as it would for an
    outage later on.
    """
    findings = engine_checks(engine)
    errors: list[Finding] = []
    for finding in findings:
        if finding.code == "redlock":
            level = {OK: logging.INFO, WARNING: logging.WARNING}.get(finding.level, logging.ERROR)
            logger.log(level, "celery-singleton-lock: %s%s", finding.message,
                       f" ({finding.action})" if finding.action else "")
        elif finding.code == "unreachable":
            logger.error("celery-singleton-lock: %s (%s)", finding.message, finding.action)
        elif finding.level == ERROR:
            errors.append(finding)
        elif finding.code.endswith("-unknown"):
            # a restricted ACL user may not read INFO or CONFIG: normal, not alarming
            logger.info("celery-singleton-lock: %s", finding.message)
        elif finding.level == WARNING:
            logger.warning("celery-singleton-lock: %s. What to do: %s",
                           finding.message, finding.action)
    if errors:
        raise ConfigurationError(
            "singleton_redis_url",
            "; ".join(f"{f.message}. What to do: {f.action}" for f in errors))
