"""``celery -A app singleton list|key|release|purge|doctor``: see and fix locks.

Plugged into Celery's command line through the ``celery.commands`` entry point.
Tables for people, ``--json`` for scripts. Exit codes: 0 done / nothing to
report, 1 refused, nothing to do, or findings to look at, 2 usage, settings or
connection error, or credentials refused. Only key hashes are ever printed,
never argument values, and every URL goes out with its password masked.

One idea: one click group, whose commands share the context they read
(app, settings, engine, the task a name means) and one way of failing (a line
and an exit code, never a traceback); what they print lives in
:mod:`.listing` and :mod:`.purge`.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import asdict
from typing import Any, Callable, Optional, Sequence, TypeVar, cast

import click
import redis
from celery.bin.base import CeleryCommand, CeleryOption

from ..observe import masking, monitor
from .listing import (
    Row,
    echo_json,
    filtered,
    headers_of,
    liveness,
    merge_views,
    read_rows,
    scan_digests,
    table,
    token_of,
)

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_ERROR = 2

#: doctor's findings that leave nothing else to check: exit code 2
UNUSABLE = ("unreachable", "not-redis", "auth")

STATES = ("run", "queued", "done", "throttled", "replaced")

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(masking.scrub(message), err=True)
    raise click.exceptions.Exit(code)


def _guarded(func: F) -> F:
    """Settings and connection errors as one line and exit code 2, never a traceback."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from ..exceptions import ConfigurationError, InvalidArgumentsError, KeyEncodingError

        try:
            return func(*args, **kwargs)
        except ConfigurationError as exc:
            _fail(f"configuration error: {exc}")
        except (KeyEncodingError, InvalidArgumentsError) as exc:
            _fail(str(exc))
        except redis.AuthenticationError as exc:
            _fail(f"lock Redis refused the credentials: {exc}")
        except redis.exceptions.NoPermissionError as exc:
            _fail(f"lock Redis denied a command (NOPERM): {exc}; "
                  "run `celery singleton doctor` as this user for the missing permission")
        except redis.exceptions.InvalidResponse as exc:
            from ..checks.doctor import not_redis

            _fail(not_redis(masking.mask_url(_lock_url(args)), exc).advice())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            _fail(f"lock Redis unreachable: {type(exc).__name__}: {exc}")
        return None
    return cast(F, wrapper)


def _lock_url(args: Sequence[Any]) -> str:
    """The lock Redis URL of the command's app (its first argument is the click
    context), for a message; "?" when it cannot be read."""
    try:
        from ..config import get_config

        return str(get_config(args[0].obj.app).redis_url)
    except Exception:
        return "?"


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, cls=CeleryOption,
                        help_group="Output Options",
                        help="Print JSON for scripts instead of a table.")(func)


class _Context:
    """The app, its settings and its engine, read once per command."""

    def __init__(self, ctx: click.Context) -> None:
        from ..config import get_config
        from ..engine.registry import engine_for

        self.app = ctx.obj.app
        if _no_app_given(self.app):
            _fail("no app given: pass -A with your Celery app's module, as for the worker "
                  "(celery -A proj singleton ...)")
        self.app.loader.import_default_modules()  # tasks listed in `include`
        self.config = get_config(self.app)
        self.engine = engine_for(self.app)
        self.url = masking.mask_url(self.config.redis_url)

    def singleton_task(self, name: str) -> Any:
        """The app's singleton task called ``name``; a usage error (exit 2)
        naming the closest singleton task names when there is none."""
        task = self.app.tasks.get(name)
        if task is None or not callable(getattr(task, "singleton_keys", None)):
            _fail(f"no singleton task named {name!r} in this app{self.did_you_mean(name)}")
        return task

    def known_task(self, name: str) -> None:
        """``--task NAME`` matched no key: a usage error (exit 2) when NAME is no
        singleton task of this app either, naming the closest ones. A name
        this app does not register but keys in Redis carry (an older release's
        task) is fine: its rows were listed."""
        task = self.app.tasks.get(name)
        if task is None or not callable(getattr(task, "singleton_keys", None)):
            _fail(f"no keys of task {name!r}, and no singleton task of that name in this "
                  f"app{self.did_you_mean(name)}")

    def did_you_mean(self, name: str) -> str:
        """``; did you mean tasks.charge?`` for the closest singleton task names."""
        names = sorted(n for n, t in self.app.tasks.items()
                       if callable(getattr(t, "singleton_keys", None)))
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        return f"; did you mean {' or '.join(close)}?" if close else ""

    @property
    def servers(self) -> list[tuple[str, redis.Redis]]:
        """Every Redis the locks live on: the masters with Redlock, else the one
        (named by its URL, password masked)."""
        servers = self.engine.servers()
        return servers if len(servers) > 1 else [(self.url, servers[0][1])]

    @property
    def client(self) -> redis.Redis:
        """The one server's client (every server's, with Redlock: :attr:`servers`)."""
        return self.servers[0][1]

    def rows(self, digests: Optional[Sequence[str]] = None) -> list[Row]:
        """What is held under ``digests`` (every key hash found with SCAN when
        None). With Redlock, every master is read and the rows merged; the
        masters that do not answer are named on stderr, and fewer than a
        majority answering is an error."""
        prefix = self.config.key_prefix
        if len(self.servers) == 1:
            return read_rows(self.client, prefix,
                         scan_digests(self.client, prefix) if digests is None else digests)
        answering: list[tuple[str, redis.Redis]] = []
        found: dict[str, None] = dict.fromkeys(digests or ())
        down: list[str] = []
        for name, client in self.servers:
            try:
                if digests is None:  # a key on any master is looked up on all
                    found.update(dict.fromkeys(scan_digests(client, prefix)))
                answering.append((name, client))
            except redis.RedisError as exc:
                down.append(f"{name} ({type(exc).__name__}: {exc})")
        views: list[list[Row]] = []
        for name, client in answering:
            try:
                views.append(read_rows(client, prefix, list(found)))
            except redis.RedisError as exc:
                down.append(f"{name} ({type(exc).__name__}: {exc})")
        if down:
            click.echo("masters not answering: " + "; ".join(down), err=True)
        if len(views) < self.engine.quorum:
            _fail(f"only {len(views)} of {len(self.servers)} masters answered; a majority "
                  f"({self.engine.quorum}) is needed to say what is held")
        return merge_views(views, len(self.servers))

    def delete_everywhere(self, key: str) -> None:
        """DEL on every server; with Redlock a master that does not answer keeps
        the key until its TTL (the next purge frees it there)."""
        servers = self.servers
        for _, client in servers:
            try:
                client.delete(key)
            except redis.RedisError:
                if len(servers) == 1:
                    raise


def _no_app_given(app: Any) -> bool:
    """`celery singleton ...` without -A (nor CELERY_APP): Celery hands over its
    default app, which has no settings of ours, nor a broker, to read. One
    configured by a config module (CELERY_CONFIG_MODULE) is used as it is."""
    from celery import _state

    conf = app.conf
    return bool(app is _state.default_app and not conf.get("singleton_redis_url")
                and not conf.get("broker_url"))


# -- the commands ------------------------------------------------------------------

@click.group(name="singleton")
def singleton() -> None:
    """See and fix singleton locks (celery-singleton-lock)."""


@singleton.command(name="list", cls=CeleryCommand)
@click.option("--task", "task_name", cls=CeleryOption, help_group="Filter Options",
              help="Only keys of this task (named by its running lock's record).")
@click.option("--state", type=click.Choice(STATES), cls=CeleryOption,
              help_group="Filter Options",
              help="run: a lock held by an execution; queued: taken when sent; "
                   "done: a success's window; throttled: a start's window; "
                   "replaced: calls a later send superseded while queued.")
@_json_option
@click.pass_context
@_guarded
def list_(ctx: click.Context, task_name: Optional[str], state: Optional[str],
          as_json: bool) -> None:
    """Every held lock, send-time marker, window and replaced record, found with SCAN."""
    c = _Context(ctx)
    rows = filtered(c.rows(), task_name, state)
    if task_name is not None and not rows:
        c.known_task(task_name)
    if as_json:
        echo_json({"redis": c.url, "locks": [asdict(r) for r in rows]})
    elif rows:
        click.echo(table(headers_of(rows), [r.cells() for r in rows]))
    else:
        click.echo(f"no singleton keys in {c.url}")


@singleton.command(cls=CeleryCommand)
@click.argument("task_name", metavar="TASK")
@click.option("--args", "args_json", default="[]", cls=CeleryOption,
              help_group="Call Options", help="Positional arguments as a JSON list.")
@click.option("--kwargs", "kwargs_json", default="{}", cls=CeleryOption,
              help_group="Call Options", help="Keyword arguments as a JSON object.")
@_json_option
@click.pass_context
@_guarded
def key(ctx: click.Context, task_name: str, args_json: str, kwargs_json: str,
        as_json: bool) -> None:
    """The key a call of TASK maps to, and who holds it. The arguments are
    hashed, never printed."""
    c = _Context(ctx)
    task = c.singleton_task(task_name)
    args = _parse_json(args_json, list, "--args", "a JSON list")
    kwargs = _parse_json(kwargs_json, dict, "--kwargs", "a JSON object")
    # only the arguments the key is made of are needed (the rest are not asked for)
    keys = task.singleton_settings().builder.keys(args, kwargs, partial=True)
    digest = keys.base[len(c.config.key_prefix) + 1:-1]
    limit = task.singleton_settings().config.limit
    rows = c.rows([digest, *(f"{digest}:{n}" for n in range(2, limit + 1))])
    if as_json:
        echo_json({"task": task_name, "key": keys.base, "lock": keys.lock, "limit": limit,
                    "held": any(r.state == "run" and r.held() for r in rows),
                    "slots_used": sum(r.state == "run" and r.held() for r in rows),
                    "locks": [asdict(r) for r in rows]})
        return
    used = sum(r.state == "run" and r.held() for r in rows)
    click.echo(f"task  {task_name}\nkey   {keys.base}\nlock  {keys.lock}"
               + (f"\nslots {used}/{limit} used" if limit > 1 else ""))
    if rows:
        click.echo(table(headers_of(rows), [r.cells() for r in rows]))
    else:
        click.echo("free: nothing holds this key")


def _parse_json(text: str, kind: type, option: str, what: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, kind):
        # the value itself is not echoed: it may be a card number
        raise click.BadParameter(f"expected {what}", param_hint=option)
    return value


def _lock_keys(text: str, prefix: str) -> Any:
    from ..keys import LockKeys

    match = re.search(r"\{([0-9a-f]{32})\}", text) or re.fullmatch(r"([0-9a-f]{32})", text)
    if match is None:
        raise click.BadParameter(f"expected a key like {prefix}{{<32 hex>}} or its 32-hex hash",
                                 param_hint="KEY")
    slot = re.search(r":lock:([0-9]+)$", text)  # a slot of singleton_limit
    return LockKeys(prefix, match.group(1)).slot(int(slot.group(1)) if slot else 1)


@singleton.command(cls=CeleryCommand)
@click.argument("key_text", metavar="KEY")
@click.option("--force", is_flag=True, cls=CeleryOption, help_group="Release Options",
              help="Release even when the holder may still run (it will see .lost).")
@_json_option
@click.pass_context
@_guarded
def release(ctx: click.Context, key_text: str, force: bool, as_json: bool) -> None:
    """Free KEY's lock, checked against the recorded owner. A holder that may
    still run (alive here, or on another host) needs --force."""
    c = _Context(ctx)
    keys = _lock_keys(key_text, c.config.key_prefix)
    record: dict[str, str] = c.engine.owner(keys)
    result: dict[str, Any] = {"key": keys.base}
    if record:
        live = liveness(record)
        result.update(holder=record.get("task", ""), host=record.get("host", ""),
                      pid=int(record.get("pid") or 0), token=token_of(record),
                      live=live, state="run")
        who = (f"task {result['holder']} (pid {result['pid']} on {result['host']}, "
               f"token {result['token']})")
        if live != "dead" and not force:
            why = "is alive on this host" if live == "alive" else "runs on another host"
            _report(result, as_json, "refused", f"refused: {who} {why}; pass --force to "
                    "release it anyway (the holder then sees its lock lost)")
        elif c.engine.release(keys, record.get("exec", ""), record.get("task", ""),
                              finished=False):
            _report(result, as_json, "released", f"released {keys.base} held by {who}")
        else:
            _report(result, as_json, "changed", f"not released: {keys.base} changed hands "
                    "since it was read; run release again")
        return
    queued = c.engine.queued_by(keys)
    if queued:
        result.update(holder=queued, state="queued")
        if not force:
            _report(result, as_json, "refused", f"refused: task {queued} took {keys.base} when "
                    "it was sent and waits in the queue; pass --force to free the key")
        elif c.engine.unqueue(keys, queued):
            _report(result, as_json, "released", f"freed {keys.base} taken at send time by "
                    f"task {queued}")
        else:
            _report(result, as_json, "changed", f"not released: {keys.base} changed hands")
        return
    _report(result, as_json, "not-held", f"nothing holds {keys.base}")


def _report(result: dict[str, Any], as_json: bool, action: str, text: str) -> None:
    result["action"] = action
    if as_json:
        echo_json(result)
    else:
        click.echo(text)
    if action != "released":
        raise click.exceptions.Exit(EXIT_FINDINGS)


@singleton.command(cls=CeleryCommand)
@click.option("--task", "task_name", required=True, cls=CeleryOption,
              help_group="Filter Options", help="The task whose keys go.")
@click.option("--yes", is_flag=True, cls=CeleryOption, help_group="Purge Options",
              help="Delete; without it, only say what would be deleted.")
@click.option("--force", is_flag=True, cls=CeleryOption, help_group="Purge Options",
              help="Free locks whose holder may still run (they will see .lost) and keys "
                   "of tasks waiting in the queue too.")
@_json_option
@click.pass_context
@_guarded
def purge(ctx: click.Context, task_name: str, yes: bool, force: bool, as_json: bool) -> None:
    """Free every key of TASK: its locks (owner-checked), send-time markers and
    done and throttle windows. A dry run unless --yes. As with release, a lock
    whose holder may still run and a key taken when a task was sent (it waits
    in the queue) are kept unless --force; so is the record of replaced calls
    (their callers were told). Fencing counters stay: tokens only go up."""
    from .purge import purge_rows, report

    c = _Context(ctx)
    rows = filtered(c.rows(), task_name, None)
    if not rows:
        c.known_task(task_name)
    outcome = purge_rows(rows, yes, force, lambda row: _purge_row(c, row))
    if report(task_name, outcome, yes, force, as_json):
        raise click.exceptions.Exit(EXIT_FINDINGS)


def _purge_row(c: _Context, row: Row) -> bool:
    from ..keys import LockKeys

    keys = LockKeys(c.config.key_prefix, row.key[len(c.config.key_prefix) + 1:-1]).slot(
        row.slot or 1)
    if row.state == "run":
        return c.engine.release(keys, row.exec, row.holder, finished=False)
    if row.state == "queued":
        return c.engine.unqueue(keys, row.holder)
    c.delete_everywhere({"throttled": keys.throttle, "replaced": keys.replaced}.get(
        row.state, keys.done))
    return True


@singleton.command(cls=CeleryCommand)
@_json_option
@click.pass_context
@_guarded
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the lock Redis for what can make a lock lie or fail: credentials,
    ACL permissions, scripts, eviction, clock, version, persistence, replicas.
    Exits 0 when all is well, 1 on findings to look at, 2 when the lock Redis
    is unreachable, is not a Redis, or refuses the credentials."""
    from ..beat.scheduler import schedule_modes
    from ..checks.doctor import beat_check, engine_checks, uses_rate
    from ..checks.findings import ERROR, OK

    c = _Context(ctx)
    findings = engine_checks(c.engine, uses_rate(c.app))  # with singleton_rate: its commands
    modes = schedule_modes(c.app)  # what a beat of this app needs; None: no beat_schedule
    if modes is not None and not any(f.code in UNUSABLE for f in findings):
        findings += beat_check(c.engine, modes)
    if as_json:
        echo_json({"redis": c.url, "findings": [f.as_dict() for f in findings]})
    else:
        for f in findings:
            click.echo(f"{f.level.upper():8} {f.code:20} {f.message}")
            if f.action:
                click.echo(f"{'':8} {'':20} -> {f.action}")
    quorum = [f for f in findings if f.code == "redlock"]
    if quorum[0].level == ERROR if quorum else any(f.code in UNUSABLE for f in findings):
        raise click.exceptions.Exit(EXIT_ERROR)
    if any(f.level != OK for f in findings):
        raise click.exceptions.Exit(EXIT_FINDINGS)


@singleton.command(cls=CeleryCommand)
@click.option("--port", type=int, default=9808, show_default=True, cls=CeleryOption,
              help_group="Metrics Options", help="Port of the HTTP server.")
@click.option("--address", default="0.0.0.0", show_default=True, cls=CeleryOption,
              help_group="Metrics Options", help="Address to listen on.")
@click.pass_context
@_guarded
def metrics(ctx: click.Context, port: int, address: str) -> None:
    """Serve the lock metrics for Prometheus on /metrics (needs the `metrics`
    extra: prometheus_client). Runs until stopped."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server

        from ..observe.metrics import SingletonCollector
    except ImportError:
        _fail("prometheus_client is not installed: pip install 'celery-singleton-lock[metrics]'")
    c = _Context(ctx)
    # unreachable or refused: exit 2 now, not at the first scrape
    monitor.read_counts(c.engine, c.config.key_prefix)
    registry = CollectorRegistry()
    registry.register(SingletonCollector(c.engine, c.config.key_prefix))
    start_http_server(port, addr=address, registry=registry)
    click.echo(f"serving lock metrics of {c.url} on http://{address}:{port}/metrics")
    import threading

    threading.Event().wait()
