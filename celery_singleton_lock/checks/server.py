"""Checks of what can make a granted lock lie: the server's version, its
eviction policy, its clock against this host's, persistence and replicas.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from redis.exceptions import (
    ResponseError,
)

from ..config import SingletonConfig
from ..engine import shapes
from ..engine.calls import CLOCK_FRACTION
from .findings import ERROR, OK, WARNING, Finding, command, server_text, setting

logger = logging.getLogger("celery_singleton_lock")

#: the oldest server our scripts run on: they read TIME before writing, which
#: needs script effects replication (the default from Redis 5.0)
MIN_VERSION = (5, 0)

#: the host's wall clock (a name of its own, so a test can set it off)
wall_clock = time.time

#: eviction policies that never evict a key; every other one may evict ours
#: (every key we write carries a TTL, so volatile-* picks them too)
SAFE_EVICTION = ("noeviction",)


def denied(what: str, command: str, exc: ResponseError) -> Finding:
    return Finding(WARNING, f"{what}-unknown",
                   f"could not read the {what} setting: {server_text(exc)}",
                   f"check it by hand, or let doctor run as a user allowed {command}")


def info_section(client: redis.Redis, section: str) -> dict[str, Any]:
    return shapes.info_dict(command(client, "INFO", section))


def version_check(client: redis.Redis) -> list[Finding]:
    try:
        info = info_section(client, "server")
    except ResponseError as exc:
        return [denied("version", "INFO", exc)]
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


def eviction_check(client: redis.Redis) -> list[Finding]:
    try:
        policy = setting(client, "maxmemory-policy") or ""
        maxmemory = int(setting(client, "maxmemory") or 0)
    except ResponseError as exc:
        return [denied("eviction", "CONFIG GET (maxmemory-policy)", exc)]
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


def clock_check(client: redis.Redis, config: SingletonConfig) -> list[Finding]:
    before = wall_clock()
    seconds, micros = command(client, "TIME")
    after = wall_clock()
    server = int(seconds) + int(micros) / 1e6
    # how far this host's clock is ahead of the server's (behind: negative)
    skew = (before + after) / 2 - server
    margin = (after - before) / 2
    limit = config.ttl * CLOCK_FRACTION
    if abs(skew) - margin > limit:
        way = "ahead of" if skew > 0 else "behind"
        return [Finding(
            WARNING, "clock",
            f"this host's clock is {abs(skew):.3f} s {way} the Redis TIME ({skew:+.3f} s), "
            "more than "
            f"{CLOCK_FRACTION:.0%} of the {config.ttl:g} s lease: a clock that far off is not "
            "kept by NTP, its rate may be off too, and lock ages read wrong",
            "run NTP (chrony, systemd-timesyncd) on the workers and on the Redis host")]
    return [Finding(OK, "clock", f"host clock within {abs(skew):.3f} s of the Redis TIME")]


def persistence_check(client: redis.Redis) -> list[Finding]:
    try:
        info = info_section(client, "persistence")
    except ResponseError as exc:
        return [denied("persistence", "INFO", exc)]
    if int(info.get("aof_enabled") or 0):
        return [Finding(OK, "persistence", "append-only file on: a restart keeps held locks "
                        "(up to the last fsync)")]
    try:
        save = setting(client, "save") or ""
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


def replication_check(client: redis.Redis) -> list[Finding]:
    try:
        info = info_section(client, "replication")
    except ResponseError as exc:
        return [denied("replication", "INFO", exc)]
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


