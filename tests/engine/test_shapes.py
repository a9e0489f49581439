"""Replies in every shape redis-py and the protocols give them, read the same."""

from __future__ import annotations

import pytest

from celery_singleton_lock.engine import shapes

pytestmark = pytest.mark.unit  # no server, no worker: the fast run (-m unit)


def test_config_get_as_dict_flat_list_bytes_and_cluster():
    assert shapes.config_value({"maxmemory-policy": "noeviction"}, "maxmemory-policy") == (
        "noeviction")
    assert shapes.config_value(["maxmemory-policy", "allkeys-lru"], "maxmemory-policy") == (
        "allkeys-lru")
    assert shapes.config_value([b"save", b""], "save") == ""
    assert shapes.config_value({"127.0.0.1:7000": ["maxmemory", "0"]}, "maxmemory") == "0"
    assert shapes.config_value([], "maxmemory") is None


def test_acl_log_entries_as_dicts():
    flat = [["count", 1, "reason", "command", "object", "get", "username", "locks"]]
    parsed = [{"count": 1, "reason": "command", "object": "get", "username": "locks"}]
    assert shapes.entries(flat) == shapes.entries(parsed) == parsed
    assert shapes.entries(None) == []


def test_info_parsed_or_raw_text():
    raw = b"# Server\r\nredis_version:6.2.6\r\nrun_id:abc\r\n"
    assert shapes.info_dict(raw) == {"redis_version": "6.2.6", "run_id": "abc"}
    assert shapes.info_dict({"redis_version": "7.0.15"}) == {"redis_version": "7.0.15"}
