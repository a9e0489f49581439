"""The checks of the lock Redis (``checks.py``), each against a real redis-server
configured to show the problem: wrong password, a restricted ACL user, an
evicting policy, a replica, no persistence, a clock set off, Redis down."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any, Iterator

import pytest
import redis

from celery_singleton_lock import ConfigurationError, SingletonConfig
from celery_singleton_lock.checks import doctor as checks
from celery_singleton_lock.checks import permissions
from celery_singleton_lock.checks import server as serverchecks
from celery_singleton_lock.checks.findings import ERROR, OK, WARNING, Finding
from celery_singleton_lock.engine import calls
from celery_singleton_lock.engine.registry import connect
from celery_singleton_lock.engine.server import LockEngine
from celery_singleton_lock.keys import LockKeys
from tests.support import ROOT, RedisServer, Worker, discard, missing, wait_for
from tests.workerapp import make_app

DOCS = ROOT / "docs" / "redis-acl.md"


def docs_rule() -> str:
    """The `ACL SETUSER` line of docs/redis-acl.md, as a reader copies it."""
    block = DOCS.read_text().split("## The minimal rule", 1)[1].split("```\n", 2)[1]
    line = block.strip()
    assert line.startswith("ACL SETUSER locks on >CHANGE-ME ")
    return line.split(">CHANGE-ME ", 1)[1]


def engine_for_url(url: str, **overrides: Any) -> LockEngine:
    return connect(SingletonConfig.defaults(url, **overrides))


def server_version(server: RedisServer) -> tuple[int, ...]:
    text = str(server.client().info("server")["redis_version"])
    return tuple(int(p) for p in text.split(".")[:2])


def by_code(findings: list[Finding]) -> dict[str, Finding]:
    return {f.code: f for f in findings}


@pytest.fixture
def acl_server() -> Iterator[RedisServer]:
    """A server of our own with user `locks` holding exactly the documented rule."""
    server = RedisServer().start()
    server.client().execute_command("ACL", "SETUSER", "locks", "on", ">lockpw",
                                    *docs_rule().split())
    yield server
    server.cleanup()


def locks_url(server: RedisServer, password: str = "lockpw") -> str:
    return f"redis://locks:{password}@127.0.0.1:{server.port}/2"


def test_docs_acl_rule_is_the_one_the_scripts_need():
    """The documented rule lists every command the Lua scripts and the library call:
    a script calling a new command without the docs saying so fails here."""
    assert docs_rule() == checks.acl_rule("singleton:", 2)
    for script in calls.SCRIPTS.values():
        for command in permissions.script_commands(script):
            if command in permissions.RATE_COMMANDS:  # singleton_rate's, listed on their own
                assert f"`{command}`" in (ROOT / "docs" / "redis-acl.md").read_text()
                continue
            assert f"+{command}" in docs_rule().split()


def test_documented_acl_rule_runs_a_real_worker_and_every_check_passes(acl_server):
    """With only the documented rule, every script loads and runs, and a real worker
    takes and frees a singleton lock; nothing is reported as an error."""
    engine = engine_for_url(locks_url(acl_server))
    findings = checks.run_checks(engine.client, engine.config)
    assert [f for f in findings if f.level == ERROR] == []
    assert by_code(findings)["scripts"].level == OK
    checks.startup_check(engine)  # raises nothing

    queue = f"q-{uuid.uuid4().hex[:8]}"
    worker = Worker(acl_server.url(), queue, lock_url=locks_url(acl_server)).start()
    try:
        app = make_app(acl_server.url(), queue, lock_url=locks_url(acl_server))
        key = uuid.uuid4().hex
        result = app.tasks["t.hold"].delay(key, 0.3, "acl")
        assert result.get(timeout=20)["tag"] == "acl"
        # the counters reach Redis too (published once a second)
        wait_for(lambda: acl_server.client(2).hgetall("singleton:stats"), 10,
                 what="the worker's counters published")
        assert "NOPERM" not in worker.logs()
        assert "Could not publish" not in worker.logs()
        assert acl_server.client(2).exists(app.tasks["t.hold"].singleton_keys(key).lock) == 0
    finally:
        discard(worker)


@pytest.mark.parametrize("command", sorted(set(permissions.PUBLISH_COMMANDS)
                                            - set(permissions.required_commands(2))))
def test_a_publishing_command_taken_away_is_a_warning_naming_it(acl_server, command):
    """Without a command only the statistics need, the locks still work: the
    checks warn, naming it, and the worker start-up check lets it start."""
    acl_server.client().execute_command("ACL", "SETUSER", "locks", f"-{command}")
    engine = engine_for_url(locks_url(acl_server))
    findings = checks.run_checks(engine.client, engine.config)
    assert [f for f in findings if f.level == ERROR] == []
    publish = by_code(findings)["publish"]
    assert publish.level == WARNING
    assert re.search(rf"\b{re.escape(command)}\b", publish.message)
    assert f"+{command}" in publish.action
    checks.startup_check(engine)  # raises nothing
    assert not [k for k in acl_server.client(2).keys("singleton:*") if k.endswith(":probe")]


@pytest.mark.parametrize("command", permissions.required_commands(2))
def test_each_command_taken_from_the_rule_is_named(acl_server, command):
    """Removing any one command of the minimal rule gives an error naming that
    command (inside scripts Redis does not name it: the checks find it), and the
    worker start-up check refuses to start."""
    if "|" in command and server_version(acl_server) < (7, 0):
        missing("redis-server before 7.0 cannot take one subcommand away (-script|load)")
    acl_server.client().execute_command("ACL", "SETUSER", "locks", f"-{command}")
    engine = engine_for_url(locks_url(acl_server))
    findings = checks.run_checks(engine.client, engine.config)
    errors = [f for f in findings if f.level == ERROR]
    assert errors, findings
    assert errors[0].code == "noperm"
    assert re.search(rf"\b{re.escape(command)}\b", errors[0].message), errors[0]
    assert f"+{command}" in errors[0].action
    assert "lockpw" not in repr(findings)
    with pytest.raises(ConfigurationError, match=re.escape(command)):
        checks.startup_check(engine)


def test_a_key_pattern_missing_the_prefix_is_named(acl_server):
    """A user allowed other keys only: the error names the prefix it cannot touch."""
    acl_server.client().execute_command("ACL", "SETUSER", "locks", "resetkeys", "~other:*")
    engine = engine_for_url(locks_url(acl_server))
    errors = [f for f in checks.run_checks(engine.client, engine.config)
              if f.level == ERROR]
    assert errors[0].code == "noperm"
    assert "keys under the prefix 'singleton:'" in errors[0].message
    assert "~singleton:*" in errors[0].action


def test_the_probe_runs_every_script_a_worker_calls():
    """The doctor and the start-up check run each script a worker may call (the
    heartbeat's write-back and Redlock's counter raise included): a script left
    out would meet a missing permission only on the bad day it is needed."""
    keys = LockKeys("singleton:", "a" * 32)
    other = LockKeys("singleton:", "b" * 32)
    probed = {name for name, *_ in permissions._probe_calls(keys, other, "t", "e")}
    assert probed == set(calls.SCRIPTS)


def test_a_key_pattern_leaving_out_the_replaced_records_names_the_script(acl_server):
    """Key patterns per suffix that forget ``:replaced`` (only ``replace`` uses
    it): the error names the script that needs it and the pattern to allow."""
    acl_server.client().execute_command(
        "ACL", "SETUSER", "locks", "resetkeys", "~singleton:*[^d]", "~singleton:*:queued")
    engine = engine_for_url(locks_url(acl_server))
    errors = [f for f in checks.run_checks(engine.client, engine.config)
              if f.level == ERROR]
    assert errors[0].code == "noperm", errors
    assert "(script enqueue)" in errors[0].message
    assert "~singleton:*" in errors[0].action


def test_acl_log_is_quoted_when_the_user_may_read_it(acl_server):
    """A user allowed ACL LOG sees Redis's own record of the denied command."""
    acl_server.client().execute_command("ACL", "SETUSER", "locks", "-get", "+acl|log")
    engine = engine_for_url(locks_url(acl_server))
    error = by_code(checks.run_checks(engine.client, engine.config))["noperm"]
    assert "ACL LOG: command get" in error.message


def test_wrong_password_is_an_auth_error_with_the_url_masked(acl_server, caplog):
    """A wrong password is `auth`, not `unreachable` nor a permission problem; the
    password never appears; the start-up check raises ConfigurationError."""
    engine = engine_for_url(locks_url(acl_server, "not-the-password"))
    findings = checks.run_checks(engine.client, engine.config)
    assert [f.code for f in findings] == ["auth"]
    assert "redis://locks:********@127.0.0.1" in findings[0].message
    assert "not-the-password" not in repr(findings)
    with pytest.raises(ConfigurationError) as raised:
        checks.startup_check(engine)
    assert "not-the-password" not in str(raised.value)


def test_the_start_up_verdict_ends_each_sentence_once(acl_server):
    """Redis's WRONGPASS text ends in a full stop of its own ("... user is
    disabled."): the verdict reads "disabled. What to do", not "disabled.."."""
    engine = engine_for_url(locks_url(acl_server, "not-the-password"))
    with pytest.raises(ConfigurationError) as raised:
        checks.startup_check(engine)
    text = str(raised.value)
    assert ". What to do: set the user and password" in text
    assert ".." not in text


def test_missing_password_is_an_auth_error():
    """A server that requires a password and a URL without one: `auth`."""
    server = RedisServer(["--requirepass", "pw"]).start()
    try:
        engine = engine_for_url(f"redis://127.0.0.1:{server.port}/2")
        assert [f.code for f in checks.run_checks(engine.client, engine.config)] == ["auth"]
    finally:
        server.cleanup()


def test_redis_down_is_unreachable_and_startup_only_logs_it(own_redis, caplog):
    """Redis merely down is `unreachable` (not auth, not NOPERM), and the start-up
    check logs an error and lets the worker start: its backend-error policy then
    decides each task until Redis is back."""
    engine = engine_for_url(own_redis.url(2), redis_options={"socket_connect_timeout": 1})
    own_redis.stop()
    findings = checks.run_checks(engine.client, engine.config)
    assert [f.code for f in findings] == ["unreachable"]
    assert "NOPERM" not in findings[0].message
    with caplog.at_level(logging.ERROR, logger="celery_singleton_lock"):
        checks.startup_check(engine)
    assert any("unreachable" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-random", "volatile-lru",
                                    "volatile-ttl"])
def test_a_policy_that_may_evict_lock_keys_is_a_warning(policy, caplog):
    """allkeys-* may evict anything; volatile-* evicts keys with a TTL, and every lock
    key has one: both warn, naming the policy and what to set; the start-up check
    logs the warning."""
    server = RedisServer(["--maxmemory-policy", policy]).start()
    try:
        engine = engine_for_url(server.url(2))
        finding = by_code(checks.run_checks(engine.client, engine.config))["eviction"]
        assert finding.level == WARNING
        assert policy in finding.message
        assert "noeviction" in finding.action
        with caplog.at_level(logging.WARNING, logger="celery_singleton_lock"):
            checks.startup_check(engine)
        assert any(policy in r.getMessage() for r in caplog.records)
    finally:
        server.cleanup()


def test_the_checks_leave_no_key_behind(own_redis):
    """The probe runs every script on a fresh key: its fencing counter (a day),
    finish and done markers (a second) are deleted with it, so a worker's
    start adds nothing to the lock Redis."""
    engine = connect(SingletonConfig.defaults(own_redis.url(0)))
    client = own_redis.client(0)
    client.flushdb()  # the test's own server
    findings = checks.run_checks(engine.client, engine.config)
    assert by_code(findings)["scripts"].level == "ok"
    assert client.dbsize() == 0, list(client.scan_iter())


@pytest.mark.parametrize("protocol", [2, 3])
def test_both_protocols_give_the_same_findings(own_redis, protocol):
    """RESP2 and RESP3 (redis-py 5 and later) answer CONFIG GET, INFO and the
    scripts in other shapes: the findings are the same."""
    if protocol == 3 and int(redis.__version__.split(".")[0]) < 5:
        missing("redis-py before 5.0 speaks RESP2 only")
    engine = engine_for_url(own_redis.url(2) + ("?protocol=3" if protocol == 3 else ""))
    findings = by_code(checks.run_checks(engine.client, engine.config))
    assert {code: f.level for code, f in findings.items()} == {
        "reachable": "ok", "version": "ok", "scripts": "ok", "eviction": "ok", "clock": "ok",
        "persistence": "warning", "replication": "ok"}


def test_noeviction_is_ok(own_redis):
    engine = engine_for_url(own_redis.url(2))
    assert by_code(checks.run_checks(engine.client, engine.config))["eviction"].level == "ok"


def test_eviction_policy_unreadable_is_said_so(acl_server):
    """A user that may not CONFIG GET: the check says it could not tell, not ok."""
    engine = engine_for_url(locks_url(acl_server))
    finding = by_code(checks.run_checks(engine.client, engine.config))["eviction-unknown"]
    assert finding.level == WARNING
    # Redis 7 names the subcommand, 6.2 the command
    assert "config|get" in finding.message or "'config' command" in finding.message


def test_a_host_clock_off_by_more_than_a_tenth_of_the_lease_warns(own_redis, monkeypatch):
    """The host clock 5 s ahead of Redis TIME with a 30 s lease: a warning giving the
    offset; the real clock is within it."""
    engine = engine_for_url(own_redis.url(2))
    assert by_code(checks.run_checks(engine.client, engine.config))["clock"].level == "ok"
    real = serverchecks.wall_clock
    monkeypatch.setattr(serverchecks, "wall_clock", lambda: real() + 5.0)
    finding = by_code(checks.run_checks(engine.client, engine.config))["clock"]
    assert finding.level == WARNING
    # the offset it gives: +5 s (ahead), give or take the TIME round trip on a busy machine
    assert " s ahead of the Redis TIME (+" in finding.message, finding.message
    offset = float(re.search(r"TIME \(([-+][0-9.]+) s\)", finding.message).group(1))  # type: ignore[union-attr]
    assert abs(offset - 5.0) < 0.5
    monkeypatch.setattr(serverchecks, "wall_clock", lambda: real() - 5.0)
    finding = by_code(checks.run_checks(engine.client, engine.config))["clock"]
    assert " s behind the Redis TIME (-" in finding.message, finding.message


def test_no_persistence_warns_and_an_append_only_file_is_ok(own_redis):
    """Without AOF or snapshots a restart forgets every lock: a warning; with AOF: ok."""
    engine = engine_for_url(own_redis.url(2))
    finding = by_code(checks.run_checks(engine.client, engine.config))["persistence"]
    assert finding.level == WARNING
    assert "forgets every held lock" in finding.message
    server = RedisServer(["--appendonly", "yes"]).start()
    try:
        engine = engine_for_url(server.url(2))
        assert by_code(checks.run_checks(engine.client, engine.config))["persistence"].level \
            == "ok"
    finally:
        server.cleanup()


def test_replicas_warn_and_a_replica_as_lock_redis_is_an_error(own_redis):
    """A primary with a replica: async replication is a warning; pointing the locks
    at the replica itself is an error (no lock can be taken there)."""
    replica = RedisServer(["--replicaof", "127.0.0.1", str(own_redis.port)]).start()
    try:
        wait_for(lambda: own_redis.client().info("replication")["connected_slaves"] == 1,
                 10, what="replica connected")
        engine = engine_for_url(own_redis.url(2))
        assert by_code(checks.run_checks(engine.client, engine.config))["replication"].level \
            == WARNING
        engine = engine_for_url(replica.url(2))
        errors = [f for f in checks.run_checks(engine.client, engine.config)
                  if f.level == ERROR]
        assert {f.code for f in errors} == {"readonly", "replica"}
        with pytest.raises(ConfigurationError, match="primary"):
            checks.startup_check(engine)
    finally:
        replica.cleanup()


def test_beat_denied_names_what_a_beat_of_these_overlap_modes_may_not_run(acl_server):
    """With the worker's rule a beat claims ticks (SET, GET); the waiting modes
    need EXISTS and GETDEL, buffer_all the sorted-set commands inside its
    scripts, which it calls by SHA as the worker does (no EVAL): each missing
    one is named, and the probes leave no key behind."""
    client = redis.Redis.from_url(locks_url(acl_server))
    admin = acl_server.client()
    assert permissions.beat_denied(client, "singleton:", []) == []
    assert permissions.beat_denied(client, "singleton:", ["skip", "allow"]) == []
    assert permissions.beat_denied(client, "singleton:", ["buffer_one"]) == ["exists", "getdel"]
    assert permissions.beat_denied(client, "singleton:", ["buffer_all"]) == [
        "exists", "zadd", "zcard", "zpopmin", "zscore"]
    # EVALSHA refused: the commands inside the scripts cannot be tried, it is named
    admin.execute_command("ACL", "SETUSER", "locks", "-evalsha", "+exists")
    assert permissions.beat_denied(client, "singleton:", ["buffer_all"]) == ["evalsha"]
    admin.execute_command("ACL", "SETUSER", "locks", "+evalsha")
    assert permissions.beat_denied(client, "singleton:", ["buffer_all", "cancel_other"]) == [
        "getdel", "zadd", "zcard", "zpopmin", "zscore"]
    admin.execute_command("ACL", "SETUSER", "locks", "+getdel", "+zadd", "+zcard", "+zpopmin",
                          "+zscore")
    assert permissions.beat_denied(client, "singleton:", list(permissions.BEAT_COMMANDS)) == []
    assert acl_server.client(2).dbsize() == 0


def test_the_beat_scripts_call_only_what_beat_commands_names():
    """buffer_all's scripts call nothing the beat's check does not try: a
    command added to them without BEAT_COMMANDS saying so fails here."""
    from celery_singleton_lock.beat import overlap

    needs = set(permissions.beat_commands(["buffer_all"])) | set(docs_rule().replace(
        "+", " ").split())
    for script in (overlap._ARRIVE, overlap._TAKE):
        assert set(permissions.script_commands(script)) <= needs, script.name
