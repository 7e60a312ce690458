"""Promises of the link that hold while another peer misbehaves: real sockets
(``ipc://`` and loopback TCP), a real flooding peer process."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

import tether_zmq._protocol as wire  # the wire itself is what a hostile peer speaks
from tether_zmq import PROTOCOL_VERSION

from .conftest import eventually
from .linked import echo_engine

pytestmark = pytest.mark.timeout(60)

FLOODER = """
import sys, zmq
address = sys.argv[1]
frame = sys.stdin.buffer.read()
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.linger = 0
socket.sndhwm = 1_000_000
socket.connect(address)
print("flooding", flush=True)
while True:
    try:
        socket.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass
    try:
        while True:
            socket.recv(zmq.NOBLOCK)  # (the engine's answers, thrown away)
    except zmq.Again:
        pass
"""


@contextlib.asynccontextmanager
async def flooder(address: str, frame: bytes) -> AsyncIterator[None]:
    """A peer process sending ``frame`` as fast as it can, until the block ends."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FLOODER,
        address,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None
    assert process.stdout is not None
    process.stdin.write(frame)
    process.stdin.close()
    try:
        async with asyncio.timeout(20):
            assert (await process.stdout.readline()).startswith(b"flooding")
        yield
    finally:
        process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def silent_front(address: str) -> AsyncIterator[zmq.asyncio.Socket]:
    """A peer that opens a session, submits one endless request, then says nothing more
    (as a front whose loop hangs would)."""
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    try:
        socket.connect(address)
        await socket.send(wire.encode(wire.Hello(0, PROTOCOL_VERSION, "silent", 1, 1 << 20)))
        async with asyncio.timeout(10):
            welcome = wire.decode(await socket.recv())
        assert isinstance(welcome, wire.Welcome)
        payload = wire.MsgpackCodec().encode({"n": 0})
        await socket.send(wire.encode(wire.Submit(1, [(1, "hung", payload)])))
        yield socket
    finally:
        socket.close(linger=0)


@pytest.mark.parametrize(
    "junk",
    [
        b"\xc1",
        b"\xdd"
        + (4 << 20).to_bytes(4, "big")
        + b"\x07\x00\xcb"
        + bytes(8)
        + b"\xc0" * ((4 << 20) - 3),
    ],
    ids=["one-byte-junk", "a-ping-padded-to-4-mib"],
)
async def test_a_silent_front_is_lost_within_two_peer_timeouts_while_another_peer_floods(
    address: str, junk: bytes
) -> None:
    """A hung front is lost after ``peer_timeout`` without a word, its requests
    cancelled once, while another peer (no session) sends frames as fast as it can:
    the engine never has nothing waiting, and judges the fronts all the same."""
    async with echo_engine(address, peer_timeout=0.3) as engine:
        bound = engine.server.address
        async with flooder(bound, junk), silent_front(bound):
            # (lost within two timeouts; a loaded machine gets ten times that)
            with contextlib.suppress(TimeoutError):
                await eventually(lambda: not engine.server.stats().fronts, timeout=6.0)
            flooded = engine.server.stats().malformed
        lost = [c for c in engine.cancelled if c.reason == "front_lost"]
        assert [c.key.rid for c in lost] == ["hung"], (
            f"a silent front (peer_timeout 0.3 s) was not lost while another peer sent "
            f"{flooded} junk frames; in flight: {engine.server.in_flight}"
        )
