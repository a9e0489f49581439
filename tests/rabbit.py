"""A RabbitMQ node of the test's own: ``rabbitmq-server`` on free loopback
ports, its data, logs and Erlang cookie in a temporary folder, no plugins.

Started in the foreground as a child of the test process (its own session, so
the whole node is stopped at once) and ready when a client can log in on its
AMQP port. Where the machine has no ``rabbitmq-server``, or it does not start,
the test is skipped, or fails under ``SINGLETON_REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional

from kombu import Connection

from tests.support import free_port, missing, wait_for

#: Debian installs the real start script here; the one on PATH (/usr/sbin)
#: switches to the rabbitmq user, who cannot write our temporary folder
_SCRIPTS = Path("/usr/lib/rabbitmq/bin")


def _script(name: str) -> Optional[str]:
    own = _SCRIPTS / name
    if own.exists():
        return str(own)
    return shutil.which(name)


class RabbitNode:
    """One RabbitMQ node: ``start()``, ``url()``, ``ctl(...)``, ``cleanup()``."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="singleton-rabbit-"))
        self.node = f"slt{os.getpid()}{uuid.uuid4().hex[:6]}@localhost"
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        (self.dir / "enabled_plugins").write_text("[].\n")

    def env(self) -> dict[str, str]:
        d = self.dir
        return {**os.environ, "HOME": str(d), "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"), "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_PID_FILE": str(d / "node.pid")}

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def log(self) -> str:
        parts = []
        for path in [self.dir / "console.log", *sorted((self.dir / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def _answers(self) -> bool:
        try:
            with Connection(self.url(), connect_timeout=1) as conn:
                conn.connect()
            return True
        except Exception:
            return False

    def start(self, timeout: float = 60) -> RabbitNode:
        server = _script("rabbitmq-server")
        if server is None or _script("rabbitmqctl") is None:
            missing("no rabbitmq-server on this machine")
        assert server is not None
        for _attempt in range(3):
            self.port = free_port()
            env = {**self.env(), "RABBITMQ_NODE_PORT": str(self.port),
                   "RABBITMQ_DIST_PORT": str(free_port())}
            with open(self.dir / "console.log", "wb") as out:
                self.proc = subprocess.Popen([server], env=env, cwd=self.dir, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            proc = self.proc
            try:
                state = wait_for(lambda p=proc: "exited" if p.poll() is not None else (
                    self._answers() or "eaddrinuse" in self.log()), timeout,
                    what="rabbitmq-server ready")
            except AssertionError:
                state = "timed out"
            if state is True:
                return self
            text = self.log()
            self._kill()
            if "eaddrinuse" not in text and "already_used" not in text:
                missing(f"rabbitmq-server did not start:\n{text[-3000:]}")
        missing("rabbitmq-server: three free ports in a row were taken first")
        return self

    def ctl(self, *args: str, timeout: float = 60) -> str:
        ctl = _script("rabbitmqctl")
        assert ctl is not None
        out = subprocess.run([ctl, "-n", self.node, *args], env=self.env(), cwd=self.dir,
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"rabbitmqctl {' '.join(args)}:\n{out.stdout}{out.stderr}"
        return out.stdout

    def set_policy(self, name: str, pattern: str, definition: dict[str, Any],
                   apply_to: str = "queues") -> None:
        self.ctl("set_policy", "--apply-to", apply_to, name, pattern, json.dumps(definition))

    def queues(self) -> dict[str, dict[str, Any]]:
        """Every queue: its type, its messages (ready and unacknowledged) and policy."""
        out = self.ctl("list_queues", "--formatter", "json", "name", "type", "messages",
                       "messages_ready", "messages_unacknowledged", "policy")
        return {q["name"]: q for q in json.loads(out)}

    def _kill(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def cleanup(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)
