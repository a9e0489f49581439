"""Which Redis the locks live on: one server, a Sentinel-managed primary, a
Cluster, or a quorum of independent masters (Redlock).

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
    least three: every lock is taken on a majority of them (:mod:`.redlock`).
    ``redlocks://`` is the same over TLS. The user, password, database and
    options apply to every master.

Nothing here opens a connection: clients connect on first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.connection import parse_url as _parse_url

#: what :func:`make_client` accepts, by mode
SCHEMES = {
    "redis": "standalone", "rediss": "standalone", "unix": "standalone",
    "sentinel": "sentinel", "sentinels": "sentinel",
    "cluster": "cluster", "clusters": "cluster",
    "redlock": "redlock", "redlocks": "redlock",
}

#: the fewest masters a ``redlock://`` URL may name
MIN_MASTERS = 3

#: what redis-py is given unless ``singleton_redis_options`` says otherwise
CLIENT_DEFAULTS: dict[str, Any] = {
    # the longest a lock call waits for a Redis that does not answer, once per
    # outage: later calls fail at once until it answers again (:mod:`.outage`)
    "socket_timeout": 2.0,
    "socket_connect_timeout": 2.0,
    "health_check_interval": 30,
    # the pool serves only rare calls (owner records, start-up checks); the
    # lock calls use the wire's own connections
    "max_connections": 8,
}


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


def make_client(url: str, options: dict[str, Any]) -> Any:
    """The redis-py client of ``url`` with ``options`` over the URL's own.

    A ``redis.Redis`` for one server and for a Sentinel-managed primary (its
    pool's connections find the primary through the sentinels), a
    ``redis.cluster.RedisCluster`` for a Cluster. A ``redlock://`` URL names
    several masters: :func:`make_clients`.
    """
    endpoint = parse(url)
    if endpoint.mode == "redlock":
        raise ValueError("a redlock:// URL names several masters: use make_clients()")
    if endpoint.mode == "standalone":
        return redis.Redis.from_url(url, **options)
    kwargs = {**endpoint.kwargs, **options}
    if endpoint.mode == "sentinel":
        from redis.sentinel import Sentinel

        sentinel_kwargs = {**endpoint.sentinel_kwargs, **kwargs.pop("sentinel_kwargs", {})}
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name in kwargs:
                sentinel_kwargs.setdefault(name, kwargs[name])
        kwargs.pop("max_connections", None)
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(endpoint.hosts), sentinel_kwargs=sentinel_kwargs)
        return sentinel.master_for(endpoint.master, **kwargs)  # type: ignore[no-untyped-call]
    from redis.cluster import ClusterNode, RedisCluster

    kwargs.pop("health_check_interval", None)
    kwargs.pop("max_connections", None)
    nodes = [ClusterNode(host, port)  # type: ignore[no-untyped-call]
             for host, port in endpoint.hosts]
    return RedisCluster(startup_nodes=nodes, **kwargs)


def make_clients(url: str, options: dict[str, Any], defaults: Optional[dict[str, Any]] = None
                 ) -> list[tuple[str, redis.Redis]]:
    """One ``redis.Redis`` per master of a ``redlock://`` URL, named ``host:port``:
    ``options`` over the URL's own over ``defaults``."""
    endpoint = parse(url)
    if endpoint.mode != "redlock":
        raise ValueError(f"not a redlock:// URL: {url.split('://', 1)[0]}://")
    kwargs = {**(defaults or {}), **endpoint.kwargs, **options}
    if kwargs.pop("ssl", False):
        kwargs["connection_class"] = redis.SSLConnection
    # a pool of our own, as from_url makes: no retry with back-off inside
    # redis-py (a master that is down must fail fast, the quorum decides)
    return [(f"{host}:{port}",
             redis.Redis(connection_pool=redis.ConnectionPool(host=host, port=port, **kwargs)))
            for host, port in endpoint.hosts]
