"""A network path of your own between your code and a Redis: delayed, paused,
or holding what was sent until you let it through.

:class:`DelayRelay` listens on a free loopback port and forwards every
connection to a server, each chunk ``delay`` seconds later in each direction
(a round trip costs twice that: the kernel on many machines has no ``netem``
to do it). :meth:`~DelayRelay.hold` keeps what clients send from reaching the
server until :meth:`~DelayRelay.let_through`, even after the client gave up and
closed its connection: a request held in a network path (a congested link, a
proxy, a partition that heals) that reaches the server long after its caller
stopped waiting. ``hold(replies=True)`` holds the server's replies instead:
the request is served, and its caller never hears of it in time.

A delay is honoured to about a millisecond: the relay's event loop waits with
``epoll``, which counts whole milliseconds, so each delayed chunk may wait up
to one more, and no delay above none makes a round trip under about 2 ms.
``precise=True`` waits with ``select`` instead, to the microsecond (a round
trip of 1 ms is about 1.3 ms on loopback); ``select`` takes only file
descriptors under 1024, so a relay made precise belongs in a process that
keeps fewer open (a benchmark's driver, not a large test session).

Imported from :mod:`celery_singleton_lock.testing` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import threading
from typing import Callable, Optional

#: how much one read of a connection forwards at most
CHUNK = 65536


class DelayRelay:
    """A TCP relay to ``host:port`` on a free loopback port (:attr:`port`)."""

    def __init__(self, port: int, host: str = "127.0.0.1", delay: float = 0.0,
                 precise: bool = False) -> None:
        self.target = (host, port)
        #: seconds each chunk waits before it is forwarded, in each direction
        self.delay = delay
        #: waits timed to the microsecond (``select``), not the millisecond
        self.precise = precise
        self.port = 0
        #: chunks sent to the server, and bytes the server sent back
        self.sent_up = 0
        self.bytes_down = 0
        self._held = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        #: set while what clients send flows, and while what the server sends does
        self._open: Optional[asyncio.Event] = None
        self._open_down: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()

    # -- control, from any thread ---------------------------------------------

    def start(self) -> DelayRelay:
        self._thread = threading.Thread(target=self._run, name="delay-relay", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def hold(self, replies: bool = False) -> None:
        """From now on, nothing clients send reaches the server until
        :meth:`let_through` (replies already on their way still arrive);
        ``replies``: the server's replies are held instead."""
        self._held = True

        def close() -> None:
            gate = self._open_down if replies else self._open
            if gate is not None:
                gate.clear()

        self._call(close)

    def let_through(self) -> None:
        """Forward what was held, in order, then everything as it comes."""
        self._held = False

        def open_() -> None:
            for gate in (self._open, self._open_down):
                if gate is not None:
                    gate.set()

        self._call(open_)

    @property
    def held(self) -> bool:
        return self._held

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._call(self._close)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None

    def __enter__(self) -> DelayRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, func: Callable[[], object]) -> None:
        """``func()`` on the relay's thread; returns once it ran."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        done = threading.Event()

        def run() -> None:
            try:
                func()
            finally:
                done.set()

        loop.call_soon_threadsafe(run)
        done.wait(5)

    # -- the relay's own thread -----------------------------------------------

    def _run(self) -> None:
        loop = (asyncio.SelectorEventLoop(selectors.SelectSelector()) if self.precise
                else asyncio.new_event_loop())
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._open = asyncio.Event()
        self._open_down = asyncio.Event()
        self._open_down.set()
        if not self._held:
            self._open.set()
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server.serve_forever()

    def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()

    async def _relay(self, client_r: asyncio.StreamReader,
                     client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        for writer in (client_w, server_w):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = asyncio.ensure_future(self._pump(client_r, server_w, up=True))
        down = asyncio.ensure_future(self._pump(server_r, client_w, up=False))
        await up  # the client's bytes all delivered (held ones included)
        # the server answers what it got; then the connection ends
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(down, 5.0)
        for writer in (client_w, server_w):
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    up: bool) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            broken = False
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                gate = self._open if up else self._open_down
                if gate is not None:
                    await gate.wait()
                if not data:
                    if not broken:
                        with contextlib.suppress(OSError, RuntimeError):
                            writer.write_eof()
                    return
                if up:
                    self.sent_up += 1
                else:
                    self.bytes_down += len(data)
                if broken:
                    continue  # the reader side is gone: count, drop
                try:
                    writer.write(data)
                    await writer.drain()
                except (OSError, RuntimeError):
                    broken = True

        sender = asyncio.ensure_future(deliver())
        while True:
            try:
                data = await reader.read(CHUNK)
            except (OSError, asyncio.IncompleteReadError):
                data = b""  # reset by its peer: what was read still goes on
            queue.put_nowait((loop.time() + self.delay, data))
            if not data:
                break
        await sender
