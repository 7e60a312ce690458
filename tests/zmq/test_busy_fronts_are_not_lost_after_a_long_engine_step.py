"""Promised (the ``peer_timeout`` docs; DESIGN invariant 12): a front is lost for
its *silence*, more than ``peer_timeout`` without a word; the engine "judges silence
after reading what waits", at least once per ``peer_timeout`` under a flood, since "the
frames of each peer are queued apart, so a flood says nothing of another front"."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

import tether_zmq._protocol as wire  # honest fronts, written at the wire
from tether_zmq import PROTOCOL_VERSION, EngineServer, MsgpackCodec, Submission

pytestmark = pytest.mark.timeout(60)

FRONTS = 6
SUBMITS = 3


class ValidatingCodec(MsgpackCodec):
    """An honest engine codec whose decode costs 6 ms (a schema check of a request)."""

    def decode(self, data: bytes, /) -> Any:
        value = super().decode(data)
        until = time.perf_counter() + 0.006
        while time.perf_counter() < until:  # (the check's CPU cost, not a wait)
            pass
        return value


@contextlib.asynccontextmanager
async def sessions(address: str, count: int) -> AsyncIterator[list[zmq.asyncio.Socket]]:
    context = zmq.asyncio.Context.instance()
    sockets = []
    try:
        for index in range(count):
            socket = context.socket(zmq.DEALER)
            socket.linger = 0
            socket.connect(address)
            sockets.append(socket)
            await socket.send(
                wire.encode(wire.Hello(0, PROTOCOL_VERSION, f"front{index}", 1, 1 << 20))
            )
            async with asyncio.timeout(10):
                assert isinstance(wire.decode(await socket.recv()), wire.Welcome)
        yield sockets
    finally:
        for socket in sockets:
            socket.close(linger=0)


async def test_busy_fronts_are_not_lost_after_a_long_engine_step(address: str) -> None:
    async with EngineServer(address, peer_timeout=0.5, codec=ValidatingCodec()) as server:
        submitted = 0
        changed = asyncio.Event()

        async def engine_loop() -> None:
            nonlocal submitted
            while True:
                events = await server.receive()
                submitted += sum(isinstance(event, Submission) for event in events)
                changed.set()

        loop_task = asyncio.create_task(engine_loop())
        try:
            async with sessions(server.address, FRONTS) as fronts:
                payload = MsgpackCodec().encode({"n": 0})
                # One long engine step begins: the fronts go on talking meanwhile.
                began = time.perf_counter()
                for index, socket in enumerate(fronts):
                    for seq in range(1, SUBMITS + 1):
                        frame = wire.Submit(seq, [(seq, f"f{index}-{seq}", payload)])
                        socket.send(wire.encode(frame), zmq.NOBLOCK)
                while time.perf_counter() < began + 0.8:  # (the step's CPU, not a wait)
                    pass
                for socket in fronts:  # each front's latest word: fresh
                    socket.send(wire.encode(wire.Ping(SUBMITS + 1, time.monotonic())), zmq.NOBLOCK)
                # The step ends; the engine takes what its fronts said.
                async with asyncio.timeout(10):
                    while submitted < FRONTS * SUBMITS and server.stats().fronts_lost == 0:
                        changed.clear()
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.5):  # (a bound, then check again)
                                await changed.wait()
                stats = server.stats()
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
    assert stats.fronts_lost == 0, (
        f"{stats.fronts_lost} of {FRONTS} talking fronts lost as silent after one long "
        f"step; {submitted} of {FRONTS * SUBMITS} submissions reached the engine loop"
    )
