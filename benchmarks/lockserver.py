"""The redis-server :mod:`benchmarks.lockcpu` measures: one of its own on a free
loopback port, under valgrind's callgrind when instructions are counted, with
what the measurement reads from it (CPU, ``INFO commandstats``, instructions).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from celery_singleton_lock.testing import free_port, redis_server_binary, wait_for


class Server:
    """A redis-server of this measurement's own; under callgrind if asked."""

    def __init__(self, callgrind: bool) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="lockcpu-")
        self.callgrind = callgrind
        binary = redis_server_binary()
        if binary is None:
            raise SystemExit("redis-server is not installed")
        self.binary = binary
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={self.dir}/callgrind.out.%p", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, decode_responses=True)
        wait_for(self._ping, 120, what="redis-server")

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def version(self) -> str:
        """``Redis 7.0.15`` or ``Valkey 9.1.2`` (which answers redis_version 7.2.4 too)."""
        info = self.client.info("server")
        if "valkey_version" in info:
            return f"Valkey {info['valkey_version']}"
        return f"Redis {info['redis_version']}"

    def cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def commandstats(self) -> dict[str, tuple[int, float]]:
        raw = self.client.info("commandstats")
        return {name[len("cmdstat_"):]: (int(v["calls"]), float(v["usec"]))
                for name, v in raw.items()}

    def instructions(self, action: str) -> int:
        """``zero``: reset the counts; ``dump``: the instructions since then."""
        if action == "zero":
            subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True,
                           capture_output=True)
            subprocess.run(["callgrind_control", "-i", "on", str(self.proc.pid)], check=True,
                           capture_output=True)
            return 0
        subprocess.run(["callgrind_control", "-i", "off", str(self.proc.pid)], check=True,
                       capture_output=True)
        before = set(Path(self.dir).glob("callgrind.out.*"))
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True,
                       capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(Path(self.dir).glob("callgrind.out.*")) - before
            for path in sorted(new):
                match = re.search(r"^totals: (\d+)", path.read_text(), re.M)
                if match:
                    return int(match.group(1))
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)
