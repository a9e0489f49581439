"""The lock deployments of the distance run (``benchmarks/distance.py``), each
behind delay relays of its own, and the RTT those relays add: one server
(Redis 7.0, or Valkey 9.1), a Cluster whose nodes announce their relays as
their addresses, Redlock's masters; the delay that makes a relay add a given
RTT, found by PING through it against PING direct."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import redis

from celery_singleton_lock.testing import CeleryWorker, DelayRelay, free_port, wait_for

from .capacityrun import valkey_binary
from .servers import Redis

DEPLOYMENTS = ("redis", "valkey", "cluster", "redlock")


# -- servers and relays ---------------------------------------------------------------

class Server(Redis):
    def start(self) -> Server:
        super().start()
        return self


def _relay(port: int) -> DelayRelay:
    return DelayRelay(port, precise=True).start()


def _cluster(primaries: int) -> tuple[list[Server], list[DelayRelay]]:
    """A Cluster of ``primaries`` nodes, each announcing its relay's port as
    its address: the slot map and every MOVED name relays, so the client
    reaches every node through one."""
    nodes = [Server(["--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                     "--cluster-node-timeout", "5000"]).start() for _ in range(primaries)]
    relays = [_relay(n.port) for n in nodes]
    binary = shutil.which("redis-cli", path=str(Path(nodes[0].binary or "").parent)) \
        or shutil.which("redis-cli")
    if binary is None:
        raise SystemExit("redis-cli is not installed: the Cluster cannot be made")
    subprocess.run([binary, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                    "--cluster-replicas", "0", "--cluster-yes"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    for node, relay in zip(nodes, relays):
        node.client().config_set("cluster-announce-port", relay.port)
    wanted = sorted(r.port for r in relays)

    def announced() -> bool:
        for node in nodes:
            try:
                slots: Any = node.client().cluster("slots")
            except redis.RedisError:
                return False
            covered = sum(int(s[1]) - int(s[0]) + 1 for s in slots)
            if covered != 16384 or sorted({int(s[2][1]) for s in slots}) != wanted:
                return False
        return True

    wait_for(announced, 30, interval=0.1, what="every node announcing its relay")
    return nodes, relays


@dataclass
class Deployment:
    """A lock deployment of the run: its servers, their relays, the URL the
    worker and the driver use (through the relays), its worker and queue."""

    name: str
    servers: list[Server]
    relays: list[DelayRelay]
    url: str
    queue: str
    worker: Optional[CeleryWorker] = None
    app: Any = None


def deployments() -> dict[str, Deployment]:
    made: dict[str, Deployment] = {}
    try:
        for name in DEPLOYMENTS:
            queue = f"dist-{name}-{uuid.uuid4().hex[:6]}"
            if name in ("redis", "valkey"):
                server = Server(binary=valkey_binary() if name == "valkey" else None).start()
                relay = _relay(server.port)
                made[name] = Deployment(name, [server], [relay],
                                        f"redis://127.0.0.1:{relay.port}/0", queue)
            elif name == "cluster":
                nodes, relays = _cluster(3)
                made[name] = Deployment(name, nodes, relays, "cluster://" + ",".join(
                    f"127.0.0.1:{r.port}" for r in relays[:2]), queue)
            else:
                masters = [Server().start() for _ in range(3)]
                relays = [_relay(m.port) for m in masters]
                made[name] = Deployment(name, masters, relays, "redlock://" + ",".join(
                    f"127.0.0.1:{r.port}" for r in relays) + "/0", queue)
    except BaseException:
        stop(made)
        raise
    return made


def stop(made: dict[str, Deployment]) -> None:
    for dep in made.values():
        if dep.worker is not None:
            dep.worker.kill_all()
            dep.worker.stop(timeout=5)
            dep.worker.log.unlink(missing_ok=True)
        for relay in dep.relays:
            relay.stop()
        for server in dep.servers:
            server.stop()


# -- the RTT each relay adds ----------------------------------------------------------

def _ping_ms(client: redis.Redis, n: int) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def _pings(target_ms: float) -> int:
    return max(5, min(40, int(400 / max(target_ms, 1.0))))


def calibrate(made: dict[str, Deployment], target_ms: float) -> dict[str, Any]:
    """The delay that makes the redis deployment's relay add ``target_ms`` to a
    round trip (the relay's own work and timer taken off), set on every relay;
    then the RTT each relay adds at it, measured."""
    dep = made["redis"]
    direct = dep.servers[0].client()
    via = redis.Redis(port=dep.relays[0].port)
    base = _ping_ms(direct, 40)
    delay = target_ms / 2000
    for _ in range(3):
        dep.relays[0].delay = max(0.0, delay)
        added = _ping_ms(via, _pings(target_ms)) - base
        delay += (target_ms - added) / 2000
    delay = max(0.0, delay)
    added_by: dict[str, float] = {}
    for d in made.values():
        for i, relay in enumerate(d.relays):
            relay.delay = delay
            server = d.servers[i]
            through = redis.Redis(port=relay.port)
            added_by[f"{d.name} {i}"] = (_ping_ms(through, max(3, _pings(target_ms) // 2))
                                         - _ping_ms(server.client(), 10))
            through.close()
    via.close()
    return {"target_ms": target_ms, "delay_ms": delay * 1e3, "direct_ping_ms": base,
            "added_ms_by_relay": added_by}


def set_delay(made: dict[str, Deployment], delay_ms: float) -> None:
    for dep in made.values():
        for relay in dep.relays:
            relay.delay = delay_ms / 1e3


def measured_rtt(made: dict[str, Deployment]) -> float:
    """The RTT the redis deployment's relay adds now, ms."""
    dep = made["redis"]
    via = redis.Redis(port=dep.relays[0].port)
    try:
        target = dep.relays[0].delay * 2e3
        return _ping_ms(via, _pings(target)) - _ping_ms(dep.servers[0].client(), 10)
    finally:
        via.close()
