"""Checks of the lock Redis: what can make a lock lie, or make every lock call fail.

A lock is only as good as the Redis under it. A wrong password or an ACL user
missing one command turns every singleton task into an endless retry; an
eviction policy that may drop keys lets a duplicate run beside its holder; a
replica or a Redis without persistence forgets grants. Each check returns
:class:`Finding` s saying what was seen and what to do; :func:`startup_check`
turns them into a worker's start-up verdict and ``celery singleton doctor``
prints them.

:mod:`.permissions` and :mod:`.serverchecks` hold the checks themselves,
:mod:`.findings` what they say. No Celery import: the checks need only a
redis-py client and the settings.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import redis
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
)

from .config import SingletonConfig
from .engine import LockEngine
from .exceptions import ConfigurationError
from .findings import ERROR, OK, WARNING, Finding, command, server_text, user_of
from .masking import mask_url
from .permissions import acl_rule as acl_rule  # documented as checks.acl_rule
from .permissions import (
    beat_denied,
    beat_refusal,
    noperm_command,
    publishing_check,
    scripts_check,
)
from .redlock import RedlockEngine
from .serverchecks import (
    clock_check,
    eviction_check,
    persistence_check,
    replication_check,
    version_check,
)

logger = logging.getLogger("celery_singleton_lock")

def run_checks(client: redis.Redis, config: SingletonConfig,
               rate: bool = False) -> list[Finding]:
    """Every check, in the order a reader fixes them: reach, authenticate,
    run the scripts, then what can make a granted lock lie (``rate``: a task
    has ``singleton_rate``, its scripts' commands are tried too)."""
    url = mask_url(config.redis_url)
    findings: list[Finding] = []
    try:
        command(client, "PING")
        findings.append(Finding(OK, "reachable", f"lock Redis at {url} answers as user "
                                                 f"{user_of(client)!r}"))
        findings.extend(version_check(client))
        findings.extend(scripts_check(client, config, rate))
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
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return [Finding(
            ERROR, "unreachable",
            f"lock Redis at {url} is unreachable: {type(exc).__name__}: {server_text(exc)}",
            "start Redis or fix the host and port in singleton_redis_url; until it is "
            "back, singleton tasks follow singleton_on_backend_error",
        )]
    return findings


def engine_checks(engine: LockEngine, rate: bool = False) -> list[Finding]:
    """:func:`run_checks` on the engine's Redis; with Redlock, on every master,
    after a summary (code ``redlock``) of which masters answer."""
    if not isinstance(engine, RedlockEngine):
        return run_checks(engine.client, engine.config, rate)
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


def beat_check(engine: LockEngine, modes: Sequence[str]) -> list[Finding]:
    """Whether the lock Redis user may run what a beat needs whose SingletonTask
    entries use these overlap modes (:func:`.beat.schedule_modes`); none when
    Redis does not answer: the checks before say so."""
    try:
        denied = beat_denied(engine.client, engine.config.key_prefix, modes)
    except redis.RedisError:
        return []
    if denied:
        return [Finding(ERROR, "beat", *beat_refusal(engine.client, denied, modes))]
    return [Finding(OK, "beat", "a beat may run what the entries of beat_schedule need "
                                f"({', '.join(modes) or 'claims only'})")]


# -- worker start-up ---------------------------------------------------------------

def startup_check(engine: LockEngine, rate: bool = False) -> None:
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
