"""The redis-py clients of the lock Redis a ``singleton_redis_url`` names
(:mod:`..urls` reads the URL): one for a server or a Sentinel-managed
primary, a Cluster client, or one per Redlock master. Nothing here opens a
connection: clients connect on first use.
"""

from __future__ import annotations

from typing import Any, Optional

import redis

from ..urls import parse

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
