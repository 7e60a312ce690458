"""An engine and a front linked in the test's own loop, for the protocol-level tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import tether
from tether_zmq import Cancellation, EngineClient, EngineServer, RequestKey, Submission


@dataclasses.dataclass
class Echo:
    """The engine loop of these tests: a submission ``{"n": k}`` gets its ``k`` outputs
    ``{"i": 1..k, "front": ...}`` at once, in one step; ``{"n": 0}`` waits for the test."""

    server: EngineServer
    submitted: list[RequestKey] = dataclasses.field(default_factory=list)
    cancelled: list[Cancellation] = dataclasses.field(default_factory=list)
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while True:
            for event in await self.server.receive():
                if isinstance(event, Submission):
                    self.submitted.append(event.key)
                    count = int(event.request["n"])
                    if count:
                        front = event.key.front.decode(errors="replace")
                        self.server.send(
                            (event.key, {"i": i, "front": front}, i == count)
                            for i in range(1, count + 1)
                        )
                else:
                    self.cancelled.append(event)
            self.changed.set()

    def key(self, rid: str) -> RequestKey:
        return next(key for key in self.submitted if key.rid == rid)


@contextlib.asynccontextmanager
async def echo_engine(address: str, **options: Any) -> AsyncIterator[Echo]:
    options.setdefault("peer_timeout", 2.0)  # protocol tests are not about liveness
    async with EngineServer(address, **options) as server:
        echo = Echo(server)
        task = asyncio.create_task(echo.run())
        try:
            yield echo
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def front(
    address: str,
    *,
    ready: bool = True,
    registry_options: dict[str, Any] | None = None,
    **options: Any,
) -> AsyncIterator[EngineClient]:
    """A front linked to ``address``; waits (bounded) for its session unless ``ready=False``."""
    options.setdefault("engine_timeout", 2.0)  # protocol tests are not about liveness
    client = EngineClient(address, **options)
    registry = tether.Registry(on_abort=client.on_abort, **(registry_options or {}))
    async with client.running(registry):
        if ready:
            async with asyncio.timeout(10):
                await client.wait_ready()
        yield client
