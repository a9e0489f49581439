"""Which Redis a ``singleton_redis_url`` names: one server, a Sentinel-managed
primary, a Cluster, or a quorum of independent masters (Redlock); its parts,
and the URLs refused (below both the settings, which check a URL, and the
engine, which connects to it).

``singleton_redis_url`` takes, besides redis-py's own ``redis://``,
``rediss://`` and ``unix://``:

``sentinel://[[user]:password@]host:port[,host:port...]/<master>[/<db>][?options]``
    The sentinels to ask and the name of the master they watch. Every lock
    connection asks them for the current primary when it connects, so after a
    failover a broken connection reconnects to the new one. ``sentinels://``
    is the same over TLS (to the primary and the sentinels). Options: those of
    a ``redis://`` URL, plus ``sentinel_username`` and ``sentinel_password``
    when the sentinels themselves require them.

``cluster://[[user]:password@]host:port[,host:port...][?options]``
    Any nodes of a Redis Cluster (the slot map is read from the first that
    answers). ``clusters://`` is the same over TLS. Database 0 only.

``redlock://[[user]:password@]host:port,host:port,host:port[,...][/<db>][?options]``
    Independent masters (no replication between them), an odd number, at
    least three: every lock is taken on a majority of them (:mod:`.engine.redlock`).
    ``redlocks://`` is the same over TLS. The user, password, database and
    options apply to every master.

Nothing here opens a connection: :mod:`.engine.servers` makes the clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.connection import parse_url as _parse_url

#: the schemes a URL may have, by the kind of deployment they name
SCHEMES = {
    "redis": "standalone", "rediss": "standalone", "unix": "standalone",
    "sentinel": "sentinel", "sentinels": "sentinel",
    "cluster": "cluster", "clusters": "cluster",
    "redlock": "redlock", "redlocks": "redlock",
}

#: the fewest masters a ``redlock://`` URL may name
MIN_MASTERS = 3



@dataclass(frozen=True)
class Endpoint:
    """A parsed ``singleton_redis_url``."""

    mode: str  # "standalone", "sentinel", "cluster" or "redlock"
    hosts: tuple[tuple[str, int], ...] = ()
    master: str = ""
    #: keyword arguments of every connection to a data node (db, auth, TLS ...)
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: keyword arguments of connections to the sentinels
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_url(url: str) -> dict[str, Any]:
    """redis-py's own reading of a ``redis://`` URL (untyped there)."""
    return dict(_parse_url(url))  # type: ignore[no-untyped-call]


def mode_of(url: str) -> str:
    return SCHEMES.get(url.split("://", 1)[0].lower(), "")


def parse(url: str) -> Endpoint:
    """Split ``url`` into its mode, hosts and connection options (ValueError if bad)."""
    mode = mode_of(url)
    if not mode:
        raise ValueError(f"unknown scheme in {url.split('://', 1)[0]!r}")
    if mode == "standalone":
        return Endpoint(mode, kwargs=parse_url(url))
    scheme, rest = url.split("://", 1)
    tls = scheme.endswith("s")
    parts = urlsplit(f"x://{rest}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts = tuple(_host(h) for h in hostlist.split(",") if h)
    if not hosts:
        raise ValueError("no host:port given")
    if mode == "redlock":
        _check_masters(hosts)
    query = parse_qsl(parts.query, keep_blank_values=True)
    sentinel_kwargs: dict[str, Any] = {}
    kept = []
    for name, value in query:
        if name in ("sentinel_username", "sentinel_password"):
            sentinel_kwargs[name.split("_", 1)[1]] = value
        else:
            kept.append((name, value))
    path = [unquote(p) for p in parts.path.split("/") if p]
    master = ""
    if mode == "sentinel":
        if not path:
            raise ValueError("no master name: sentinel://host:port/<master>[/<db>]")
        master, path = path[0], path[1:]
    if len(path) > 1 or (path and not path[0].isdigit()):
        raise ValueError(f"unexpected path {parts.path!r}")
    db = path[0] if path else "0"
    if mode == "cluster" and db != "0":
        raise ValueError("Redis Cluster has database 0 only")
    auth = f"{userinfo}@" if userinfo else ""
    kwargs = parse_url(f"{'rediss' if tls else 'redis'}://{auth}h/{db}"
                       f"{'?' + urlencode(kept) if kept else ''}")
    kwargs.pop("host", None)
    if tls:
        kwargs.pop("connection_class", None)
        kwargs["ssl"] = True
        if mode == "sentinel":
            sentinel_kwargs.update({k: v for k, v in kwargs.items() if k.startswith("ssl")})
    if mode == "cluster":
        kwargs.pop("db", None)
    return Endpoint(mode, hosts, master, kwargs, sentinel_kwargs)


def _check_masters(hosts: tuple[tuple[str, int], ...]) -> None:
    names = [f"{host}:{port}" for host, port in hosts]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"master {', '.join(twice)} given twice: each master counts once")
    if len(hosts) < MIN_MASTERS or len(hosts) % 2 == 0:
        raise ValueError(
            f"redlock:// needs an odd number of masters, at least {MIN_MASTERS} (a majority "
            f"of an even number tolerates no more failures than one master fewer); "
            f"got {len(hosts)}: {', '.join(names)}")


def _host(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)
