"""singleton_redis_url for Sentinel and Cluster: what each form means (no servers)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_singleton_lock import ConfigurationError, get_config
from celery_singleton_lock.engine.servers import make_client, make_clients
from celery_singleton_lock.urls import parse

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def test_a_sentinel_url_names_every_sentinel_the_master_the_db_and_the_auth():
    got = parse("sentinel://app:pw@10.0.0.1:26379,[::1]:26380/mymaster/2"
                "?sentinel_password=spw&socket_timeout=3")
    assert got.mode == "sentinel" and got.master == "mymaster"
    assert got.hosts == (("10.0.0.1", 26379), ("::1", 26380))
    assert got.kwargs["db"] == 2 and got.kwargs["username"] == "app"
    assert got.kwargs["password"] == "pw" and got.kwargs["socket_timeout"] == 3.0
    assert got.sentinel_kwargs == {"password": "spw"}


def test_sentinels_scheme_is_tls_to_the_primary_and_the_sentinels():
    got = parse("sentinels://h:26379/m?ssl_cert_reqs=none")
    assert got.kwargs["ssl"] is True and got.kwargs["ssl_cert_reqs"] == "none"
    assert got.sentinel_kwargs["ssl_cert_reqs"] == "none"


def test_a_cluster_url_takes_any_nodes_and_database_0_only():
    got = parse("cluster://:pw@h1:7000,h2:7001")
    assert got.mode == "cluster" and got.hosts == (("h1", 7000), ("h2", 7001))
    assert got.kwargs == {"password": "pw"}
    with pytest.raises(ValueError, match="database 0 only"):
        parse("cluster://h1:7000/3")


def test_making_a_sentinel_client_opens_no_connection():
    """Nothing listens on port 1: a client is made, nothing is dialled."""
    client = make_client("sentinel://127.0.0.1:1/mymaster/0", {})
    assert client.connection_pool.service_name == "mymaster"


@pytest.mark.parametrize("url,message", [
    ("sentinel://h:26379", "no master name"),
    ("sentinel://h/m", "expected host:port"),
    ("cluster://h:1/x/y", "unexpected path"),
])
def test_a_bad_deployment_url_is_named_at_start(url, message):
    app = Celery("cfg", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = url
    with pytest.raises(ConfigurationError) as info:
        get_config(app)
    assert info.value.setting == "singleton_redis_url" and message in str(info.value)


def test_a_redlock_url_names_every_master_the_db_and_the_auth():
    got = parse("redlock://app:pw@h1:6379,h2:6380,[::1]:6381/2?socket_timeout=0.2")
    assert got.mode == "redlock"
    assert got.hosts == (("h1", 6379), ("h2", 6380), ("::1", 6381))
    assert got.kwargs["db"] == 2 and got.kwargs["username"] == "app"
    assert got.kwargs["password"] == "pw" and got.kwargs["socket_timeout"] == 0.2
    assert parse("redlocks://h1:1,h2:2,h3:3?ssl_cert_reqs=none").kwargs["ssl"] is True


def test_redlock_clients_are_one_per_master_and_dial_nothing():
    """Nothing listens on these ports: the clients are made, nothing is dialled;
    the URL's timeout wins over a default, an explicit option over the URL."""
    clients = make_clients("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/4?socket_timeout=0.2",
                           {"socket_connect_timeout": 0.3}, {"socket_timeout": 9.0})
    assert [name for name, _ in clients] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    kwargs = clients[0][1].connection_pool.connection_kwargs
    assert kwargs["db"] == 4 and kwargs["socket_timeout"] == 0.2
    assert kwargs["socket_connect_timeout"] == 0.3
    with pytest.raises(ValueError, match="make_clients"):
        make_client("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", {})


@pytest.mark.parametrize("url,message", [
    ("redlock://h1:1,h2:2", "odd number of masters, at least 3"),
    ("redlock://h1:1,h2:2,h3:3,h4:4", "got 4: h1:1, h2:2, h3:3, h4:4"),
    ("redlock://h1:1,h2:2,h1:1", "master h1:1 given twice"),
    ("redlock://h1:1,h2,h3:3", "expected host:port, got 'h2'"),
    ("redlock://h1:1,h2:2,h3:3/x", "unexpected path"),
])
def test_a_bad_redlock_url_is_named_at_start(url, message):
    app = Celery("cfg", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_redis_url = url
    with pytest.raises(ConfigurationError) as info:
        get_config(app)
    assert info.value.setting == "singleton_redis_url" and message in str(info.value)
