"""A lock Redis on a network path the tests can cut: a network namespace of its
own (``ip netns``), reached over veth pairs, with ``nft`` rules inside it.

The workers reach the server over one pair, the test over another: :meth:`cut`
drops every packet of the workers' path (a partition: connections hang, new
ones get no answer), :meth:`lose` a share of them at random (a lossy link),
:meth:`heal` takes the rules away. The test's own path is never touched, so it
can look at the server all along. Needs root, ``ip`` (iproute2) and ``nft``
(nftables); without them, :func:`tests.support.missing`.
"""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Optional

import redis

from celery_singleton_lock.testing import RedisServer, redis_server_binary
from tests.support import missing


def _run(*args: str, stdin: str = "") -> None:
    out = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")


def _check_tools() -> None:
    if os.geteuid() != 0:
        missing("root (network namespaces and nft rules)")
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            missing(f"{tool} (apt-get install {package})")


class IsolatedRedis(RedisServer):
    """A redis-server in a network namespace of its own (see the module)."""

    def __init__(self) -> None:
        _check_tools()
        tag = uuid.uuid4().hex[:8]
        self.netns = f"slk-{tag}"
        self.worker_if, self.admin_if = f"slkw{tag}", f"slka{tag}"
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True,
                              text=True).stdout
        while True:
            net = random.randrange(20, 250)
            if f" 10.{net}." not in used:
                break
        self.worker_ip, self.admin_ip = f"10.{net}.1.2", f"10.{net}.2.2"
        self._setup(net)
        home = Path(tempfile.mkdtemp(prefix="singleton-netns-"))
        wrapper = home / "redis-server"
        wrapper.write_text(f"#!/bin/sh\nexec ip netns exec {self.netns} "
                           f"{redis_server_binary()} \"$@\"\n")
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        super().__init__(["--bind", f"{self.worker_ip} {self.admin_ip}"], binary=str(wrapper))

    def _setup(self, net: int) -> None:
        _run("ip", "netns", "add", self.netns)
        for ifname, subnet in ((self.worker_if, 1), (self.admin_if, 2)):
            peer = f"{ifname}p"
            _run("ip", "link", "add", ifname, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", peer, "netns", self.netns)
            _run("ip", "addr", "add", f"10.{net}.{subnet}.1/24", "dev", ifname)
            _run("ip", "link", "set", ifname, "up")
            _run("ip", "netns", "exec", self.netns, "ip", "addr", "add",
                 f"10.{net}.{subnet}.2/24", "dev", peer)
            _run("ip", "netns", "exec", self.netns, "ip", "link", "set", peer, "up")
        _run("ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up")
        _run("ip", "netns", "exec", self.netns, "nft", "-f", "-", stdin=(
            "table inet slk {\n"
            "  chain input { type filter hook input priority 0; policy accept; }\n"
            "  chain output { type filter hook output priority 0; policy accept; }\n"
            "}\n"))

    def url(self, db: int = 0) -> str:
        """The workers' path."""
        return f"redis://{self.worker_ip}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """The test's own path, never cut."""
        return redis.Redis(host=self.admin_ip, port=self.port, db=db, decode_responses=True)

    def monitor(self) -> Monitor:
        """Every command the server runs from now on, read over the test's path."""
        return Monitor(self.admin_ip, self.port)

    def _nft(self, *rule: str) -> None:
        _run("ip", "netns", "exec", self.netns, "nft", *rule)

    def cut(self) -> None:
        """Drop every packet of the workers' path, both ways."""
        self._nft("add", "rule", "inet", "slk", "input", "iifname", f"{self.worker_if}p", "drop")
        self._nft("add", "rule", "inet", "slk", "output", "oifname", f"{self.worker_if}p",
                  "drop")

    def lose(self, percent: int) -> None:
        """Drop ``percent`` % of the workers' packets, each way, at random."""
        for chain, side in (("input", "iifname"), ("output", "oifname")):
            self._nft("add", "rule", "inet", "slk", chain, side, f"{self.worker_if}p",
                      "numgen", "random", "mod", "100", "<", str(percent), "drop")

    def heal(self) -> None:
        for chain in ("input", "output"):
            self._nft("flush", "chain", "inet", "slk", chain)

    def cleanup(self) -> None:
        super().cleanup()
        for args in (("ip", "link", "del", self.worker_if), ("ip", "link", "del", self.admin_if),
                     ("ip", "netns", "del", self.netns)):
            subprocess.run(args, capture_output=True, timeout=30)


#: one argument of a MONITOR line, quoted and escaped as the server writes it
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", '"': '"', "\\": "\\"}


def _unescape(arg: str) -> str:
    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return chr(int(code[1:], 16)) if len(code) == 3 else _ESCAPES.get(code, code)

    return re.sub(r"\\(x[0-9a-f]{2}|.)", one, arg)


class Monitor:
    """``MONITOR`` on a connection of its own, read by a thread until
    :meth:`stop`: each command the server ran, in the order it ran them (a
    script's own commands, client ``lua``, right after its ``EVALSHA``), as
    (the server's clock in seconds, the client, the arguments)."""

    def __init__(self, host: str, port: int) -> None:
        self.lines: list[tuple[float, str, list[str]]] = []
        self._sock = socket.create_connection((host, port), timeout=10)
        self._sock.sendall(b"*1\r\n$7\r\nMONITOR\r\n")
        self._stopped = threading.Event()
        self._buf = b""
        first = self._line(10.0)
        if first != "+OK":
            raise RuntimeError(f"MONITOR: {first!r}")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _line(self, timeout: float) -> Optional[str]:
        while b"\r\n" not in self._buf:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                return None
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionError("MONITOR connection closed")
            self._buf += data
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line.decode("utf-8", "replace")

    def _read(self) -> None:
        while True:
            line = self._line(0.2)
            if line is None:
                if self._stopped.is_set():
                    return  # nothing more came in a while after stop()
                continue
            if not line.startswith("+"):
                continue
            stamp, _, rest = line[1:].partition(" [")
            client, _, args = rest.partition("] ")
            self.lines.append((float(stamp), client.partition(" ")[2],
                               [_unescape(a) for a in _ARG.findall(args)]))

    def stop(self) -> list[tuple[float, str, list[str]]]:
        """Stop reading (what the server sent so far is read first); the lines."""
        self._stopped.set()
        self._thread.join(10)
        self._sock.close()
        return self.lines
