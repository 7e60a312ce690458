"""The middleware chains the server's shutdown signals during the lifespan: the
server's handler still runs, and the registry starts draining at once.

These drive the lifespan by hand on the test's loop (the main thread), with a
stand-in for the server's handler; the command-line servers themselves are tested in
``tests/fastapi/test_shutdown_from_the_command_line.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

import tether
from tests._support.waiting import eventually
from tether_starlette import TetherMiddleware

from .conftest import BOUND


class ServerHandler:
    """Stands for the handler a server installs: records the signals it got."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.arrived = asyncio.Event()

    def __call__(self, sig: int, frame: FrameType | None) -> None:
        self.got.append(sig)
        self.arrived.set()


@contextlib.contextmanager
def server_handlers(handler: Any) -> Iterator[None]:
    """Install ``handler`` for SIGINT and SIGTERM as a server does, and restore the
    test process's own afterwards."""
    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


class Lifespan:
    """Drives an app's lifespan as a server does: start-up now, shutdown on demand."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.sent: list[str] = []
        self.started = asyncio.Event()

    async def receive(self) -> Message:
        return await self.inbox.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message["type"])
        if message["type"] == "lifespan.startup.complete":
            self.started.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.inbox.put_nowait({"type": "lifespan.startup"})
        task = asyncio.create_task(self.app(scope, self.receive, self.send))
        try:
            async with asyncio.timeout(BOUND):
                await self.started.wait()
            yield
            self.inbox.put_nowait({"type": "lifespan.shutdown"})
            async with asyncio.timeout(BOUND):
                await task
        finally:
            task.cancel()
            await asyncio.wait([task])


def lifespan_app(on_shutdown: list[bool], registry: tether.Registry) -> Any:
    """A bare ASGI lifespan that notes whether the registry was closed by the time its
    own shutdown began."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        assert (await receive())["type"] == "lifespan.shutdown"
        on_shutdown.append(registry.closed)
        await send({"type": "lifespan.shutdown.complete"})

    return app


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_the_servers_signal_reaches_its_handler_and_starts_the_drain(
    sig: signal.Signals,
) -> None:
    registry = tether.Registry()
    stream = registry.open()  # in flight: the drain aborts it after its timeout
    handler = ServerHandler()
    on_shutdown: list[bool] = []
    app = TetherMiddleware(lifespan_app(on_shutdown, registry), registry=registry, drain_timeout=0)
    with server_handlers(handler):
        lifespan = Lifespan(app)
        async with lifespan.running():
            assert not registry.closed
            signal.raise_signal(sig)
            async with asyncio.timeout(BOUND):
                await handler.arrived.wait()
                with pytest.raises(tether.Aborted):
                    await stream.result()
            assert registry.closed
            assert handler.got == [sig]
        assert signal.getsignal(sig) is handler  # the chain is undone at shutdown

    assert on_shutdown == [True]
    assert lifespan.sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_a_signal_the_server_does_not_handle_is_left_alone() -> None:
    registry = tether.Registry()
    app = TetherMiddleware(lifespan_app([], registry), registry=registry)
    with server_handlers(signal.SIG_IGN):
        async with Lifespan(app).running():
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)  # ignored, as the server wants
        assert not registry.closed


async def test_no_drain_timeout_leaves_the_servers_signals_alone() -> None:
    registry = tether.Registry()
    handler = ServerHandler()
    app = TetherMiddleware(lifespan_app([], registry), registry=registry, drain_timeout=None)
    with server_handlers(handler):
        async with Lifespan(app).running():
            assert signal.getsignal(signal.SIGTERM) is handler


async def test_installed_twice_the_signals_are_chained_once() -> None:
    registry = tether.Registry()
    handler = ServerHandler()
    inner = TetherMiddleware(lifespan_app([], registry), registry=registry)
    outer = TetherMiddleware(inner, registry=registry)
    with server_handlers(handler):
        async with Lifespan(outer).running():
            chained = signal.getsignal(signal.SIGTERM)
            assert chained is not handler
            assert getattr(chained, "__self__", None) is not None
            signal.raise_signal(signal.SIGTERM)
            async with asyncio.timeout(BOUND):
                await handler.arrived.wait()
            assert handler.got == [signal.SIGTERM]  # once: one link in the chain
        assert signal.getsignal(signal.SIGTERM) is handler


async def test_a_handler_put_in_front_of_ours_keeps_the_chain_whole() -> None:
    registry = tether.Registry()
    handler = ServerHandler()
    app = TetherMiddleware(lifespan_app([], registry), registry=registry)
    later: list[int] = []
    with server_handlers(handler):
        async with Lifespan(app).running():
            ours = signal.getsignal(signal.SIGTERM)
            assert callable(ours)

            def in_front(sig: int, frame: FrameType | None) -> None:
                later.append(sig)
                ours(sig, frame)

            signal.signal(signal.SIGTERM, in_front)
        # Ours could not be taken out of the chain: it forwards, and drains no more.
        assert signal.getsignal(signal.SIGTERM) is in_front
        signal.raise_signal(signal.SIGTERM)
        async with asyncio.timeout(BOUND):
            await handler.arrived.wait()
        assert later == [signal.SIGTERM]
        assert handler.got == [signal.SIGTERM]
    assert not registry.closed


async def test_a_second_signal_ends_the_drain_at_once() -> None:
    registry = tether.Registry()
    stream = registry.open()
    handler = ServerHandler()
    app = TetherMiddleware(lifespan_app([], registry), registry=registry, drain_timeout=3600)
    with server_handlers(handler):
        async with Lifespan(app).running():
            signal.raise_signal(signal.SIGINT)
            await eventually(lambda: registry.closed)  # (the drain starts on the loop's turn)
            assert stream.rid in registry  # draining: the request may still finish
            signal.raise_signal(signal.SIGINT)  # uvicorn: force the exit
            async with asyncio.timeout(BOUND):
                with pytest.raises(tether.Aborted):
                    await stream.result()
    assert handler.got == [signal.SIGINT, signal.SIGINT]
