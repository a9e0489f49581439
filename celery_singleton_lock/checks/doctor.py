"""Checks of the lock Redis: what can make a lock lie, or make every lock call fail.

A lock is only as good as the Redis under it. A wrong password or an ACL user
missing one command turns every singleton task into an endless retry; an
eviction policy that may drop keys lets a duplicate run beside its holder; a
replica or a Redis without persistence forgets grants. Each check returns
:class:`Finding` s saying what was seen and what to do; :func:`startup_check`
turns them into a worker's start-up verdict and ``celery singleton doctor``
prints them.

:mod:`.permissions` and :mod:`.server` hold the checks themselves,
:mod:`.findings` what they say. No Celery import: the checks need only a
redis-py client and the settings.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Sequence

import redis
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
)

from ..config import SingletonConfig
from ..engine.base import Engine
from ..exceptions import ConfigurationError
from ..observe.masking import mask_url
from .findings import ERROR, OK, WARNING, Finding, command, server_text, user_of
from .permissions import acl_rule as acl_rule
from .permissions import beat_denied, beat_refusal, noperm_command, publishing_check, scripts_check
from .server import clock_check, eviction_check, persistence_check, replication_check, version_check

logger = logging.getLogger("celery_singleton_lock")

def run_checks(client: redis.Redis, config: SingletonConfig, *, scripts: bool = True,
               rate: bool = False) -> list[Finding]:
    """Every check, in the order a reader fixes them: reach, authenticate,
    run the scripts, then what can make a granted lock lie. ``scripts``
    False: the server runs no script, and the lock takes none (the native
    path, :mod:`..engine.native`): that is said instead of checking them.
    ``rate``: a task has ``singleton_rate``, its scripts' commands are tried too."""
    url = mask_url(config.redis_url)
    findings: list[Finding] = []
    try:
        command(client, "PING")
        findings.append(Finding(OK, "reachable", f"lock Redis at {url} answers as user "
                                                 f"{user_of(client)!r}"))
        findings.extend(version_check(client))
        findings.extend(scripts_check(client, config, rate) if scripts
                        else [no_scripts(client)])
        findings.extend(publishing_check(client, config))
        findings.extend(eviction_check(client))
        findings.extend(clock_check(client, config))
        findings.extend(persistence_check(client))
        findings.extend(replication_check(client))
    except NoPermissionError as exc:
        # PING, or SELECT on connect: Redis names the command
        return [*findings, noperm_command(client, config, exc)]
    except AuthenticationError as exc:
        return [Finding(
            ERROR, "auth",
            f"lock Redis at {url} refused the credentials of user {user_of(client)!r}: "
            f"{server_text(exc)}",
            "set the user and password in singleton_redis_url "
            "(redis://user:password@host:port/db) or singleton_redis_options",
        )]
    except redis.exceptions.InvalidResponse as exc:
        return [not_redis(url, exc)]
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return [Finding(
            ERROR, "unreachable",
            f"lock Redis at {url} is unreachable: {type(exc).__name__}: {server_text(exc)}",
            "start Redis or fix the host and port in singleton_redis_url; until it is "
            "back, singleton tasks follow singleton_on_backend_error",
        )]
    return findings


def no_scripts(client: redis.Redis) -> Finding:
    return Finding(
        WARNING, "scripts",
        f"the lock Redis runs no script for user {user_of(client)!r}: tasks lock in plain "
        "commands (DELIFEQ or DELEX, SET IFEQ), and a task whose options need a script "
        "(singleton_scope queue or queue_and_run, singleton_limit, singleton_throttle, "
        "'replace', singleton_wait_replicas, singleton_also_lock) is refused at start",
        "allow EVALSHA and SCRIPT LOAD for those options (docs/deployments.md#native-commands)")


def not_redis(url: str, exc: BaseException) -> Finding:
    """Something answered at the lock Redis's address, in another protocol (an
    HTTP server, a database, a TLS port spoken to in plain text): no lock call
    can ever work there."""
    said = str(exc).removeprefix("Protocol Error:").strip() or type(exc).__name__
    quoted = re.fullmatch(r"b(['\"])(.*)\1", said)  # redis-py shows the bytes' repr
    said = f'"{quoted.group(2)}"' if quoted else said
    return Finding(
        ERROR, "not-redis",
        f"lock Redis at {url} answers, but not as Redis does: it said {said}",
        "point singleton_redis_url at the Redis host and port (rediss:// if that port "
        "speaks TLS); that address serves something else")


def uses_rate(app: Any) -> bool:
    """The app sets ``singleton_rate``, or one of its tasks does: the start-up
    check then tries the rate-limited acquire too (its commands)."""
    if app.conf.get("singleton_rate"):
        return True
    return any(getattr(task, "singleton_rate", None) for task in app.tasks.values())


def engine_checks(engine: Engine, rate: bool = False) -> list[Finding]:
    """:func:`run_checks` on the engine's Redis; where the locks live on several
    (Redlock), on every master, after a summary (code ``redlock``) of which
    masters answer."""
    servers = engine.servers()
    if len(servers) == 1:
        client = servers[0][1]
        try:
            how, scripts = engine.lock_path()
        except redis.RedisError:  # the checks say why it does not answer
            return run_checks(client, engine.config, rate=rate)
        found = run_checks(client, engine.config, scripts=scripts, rate=rate)
        if found and found[0].code == "reachable":
            found.insert(1, Finding(OK, "commands", f"lock calls: {how}"))
        return found
    findings: list[Finding] = []
    answering: list[str] = []
    silent: list[str] = []
    for name, client in servers:
        config = dataclasses.replace(engine.config, redis_url=f"redis://{name}")
        own = run_checks(client, config, rate=rate)
        down = any(f.code in ("unreachable", "not-redis") for f in own)
        (silent if down else answering).append(name)
        findings.extend(dataclasses.replace(f, message=f"master {name}: {f.message}")
                        for f in own)
    total, quorum = len(servers), engine.quorum
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


def beat_check(engine: Engine, modes: Sequence[str]) -> list[Finding]:
    """Whether the lock Redis user may run what a beat needs whose SingletonTask
    entries use these overlap modes (:func:`.beat.schedule_modes`); none when
    Redis does not answer: the checks before say so."""
    for _, client in engine.servers():  # beat's keys are on every master of Redlock
        try:
            denied = beat_denied(client, engine.config.key_prefix, modes)
        except redis.RedisError:
            return []
        if denied:
            return [Finding(ERROR, "beat", *beat_refusal(client, denied, modes))]
    return [Finding(OK, "beat", "a beat may run what the entries of beat_schedule need "
                                f"({', '.join(modes) or 'claims only'})")]


# -- worker start-up ---------------------------------------------------------------

def startup_check(engine: Engine, rate: bool = False) -> None:
    """Check the lock Redis when a worker starts.

    A wrong password or a missing permission fails every lock call for as long
    as the worker runs, so it stops the start (ConfigurationError). Redis merely
    down is logged and the start goes on: it may be back in seconds, and until
    then ``singleton_on_backend_error`` decides each task, as it would for an
    outage later on. ``rate``: a task of the app has ``singleton_rate``.
    """
    findings = engine_checks(engine, rate)
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
            logger.warning("celery-singleton-lock: %s", finding.advice())
    if errors:
        raise ConfigurationError(
            "singleton_redis_url",
            "; ".join(f.advice() for f in errors))
