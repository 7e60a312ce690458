"""Hostile or confused peers: malformed and oversized frames, version mismatches,
sequence gaps, messages without a session. Each is counted and dropped (or ends that
one session), and the loops keep serving the honest fronts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

import tether_zmq._protocol as wire  # the wire format itself is what these tests poke at
from tether_zmq import PROTOCOL_VERSION, EngineServer

from .conftest import eventually
from .linked import echo_engine, front

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def raw_peer(
    kind: int, address: str, *, identity: bytes | None = None
) -> AsyncIterator[zmq.asyncio.Socket]:
    """A bare socket speaking whatever the test sends."""
    socket = zmq.asyncio.Context.instance().socket(kind)
    socket.linger = 0
    if identity is not None:
        socket.setsockopt(zmq.ROUTING_ID, identity)
    try:
        if kind == zmq.ROUTER:
            socket.bind(address)
        else:
            socket.connect(address)
        yield socket
    finally:
        socket.close(linger=0)


async def answer(socket: zmq.asyncio.Socket) -> wire.Message:
    async with asyncio.timeout(10):
        frames = await socket.recv_multipart()
    return wire.decode(frames[-1])


async def say_hello(peer: zmq.asyncio.Socket, attempt: int = 1) -> wire.Welcome:
    """Open a session from a raw peer; returns the engine's welcome."""
    await peer.send(wire.encode(wire.Hello(0, PROTOCOL_VERSION, "raw", attempt, 1 << 20)))
    welcome = await answer(peer)
    assert isinstance(welcome, wire.Welcome)
    return welcome


async def welcome_every_hello(
    fake: zmq.asyncio.Socket, *, version: int = PROTOCOL_VERSION, before: list[bytes] = ()
) -> None:
    """A fake engine: answers every hello (a front says hello again until answered),
    sending the frames ``before`` first."""
    while True:
        identity, frame = await fake.recv_multipart()
        hello = wire.decode(frame)
        if isinstance(hello, wire.Hello):
            for junk in before:
                await fake.send_multipart([identity, junk])
            welcome = wire.Welcome(0, version, "fake", hello.attempt, 1 << 20)
            await fake.send_multipart([identity, wire.encode(welcome)])


@contextlib.asynccontextmanager
async def fake_engine(address: str, **options: object) -> AsyncIterator[str]:
    """A fake engine bound to ``address``; yields the bound endpoint."""
    async with raw_peer(zmq.ROUTER, address) as fake:
        task = asyncio.create_task(welcome_every_hello(fake, **options))  # type: ignore[arg-type]
        try:
            yield fake.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def assert_still_serves(server: EngineServer) -> None:
    async with front(server.address) as client, asyncio.timeout(10):
        assert [o["i"] async for o in client.open({"n": 2})] == [1, 2]


async def test_a_hello_with_another_protocol_version_is_refused(address: str) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(wire.encode(wire.Hello(0, PROTOCOL_VERSION + 1, "future", 1, 1 << 20)))
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert reply.version == PROTOCOL_VERSION
        assert engine.server.stats().refused == 1
        assert engine.server.stats().fronts == 0
        await assert_still_serves(engine.server)


async def test_a_front_never_opens_a_session_with_an_engine_of_another_version(
    address: str,
) -> None:
    async with (
        fake_engine(address, version=PROTOCOL_VERSION + 1) as bound,
        front(bound, ready=False) as client,
    ):
        await eventually(lambda: client.stats().refused >= 1)
        assert not client.ready
        with pytest.raises(tether_zmq.EngineUnavailable, match="protocol"):
            client.open({"n": 1})


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"\xc1"], id="not-msgpack"),
        pytest.param([b"\x93\x63\x00\x00"], id="unknown-tag"),
        pytest.param([msgspec.msgpack.encode([4, 0, "not a list"])], id="wrong-field-type"),
        pytest.param([b"a", b"b"], id="two-frames"),
        pytest.param([b""], id="empty"),
    ],
)
async def test_a_malformed_frame_is_counted_and_dropped(address: str, frames: list[bytes]) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send_multipart(frames)
        await eventually(lambda: engine.server.stats().malformed == 1)
        await assert_still_serves(engine.server)


async def test_a_frame_past_max_message_never_reaches_the_engine_loop(address: str) -> None:
    async with (
        echo_engine(address, max_message=4096) as engine,
        raw_peer(zmq.DEALER, engine.server.address) as peer,
    ):
        hello = wire.encode(wire.Hello(0, PROTOCOL_VERSION, "big", 1, 1 << 20))
        await peer.send(hello + b"\x00" * 8192)  # libzmq drops this peer's connection
        async with front(engine.server.address, max_message=4096) as client:
            async with asyncio.timeout(10):
                assert [o["i"] async for o in client.open({"n": 2})] == [1, 2]
        stats = engine.server.stats()
        assert stats.malformed == 0
        assert stats.submitted == 1  # the honest front's only


async def test_a_message_without_a_session_is_answered_say_hello(address: str) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(wire.encode(wire.Submit(5, [(1, "r", b"\x80")])))
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert "hello" in reply.reason
        assert engine.server.stats().no_session == 1
        assert engine.server.stats().submitted == 0


async def test_a_sequence_gap_ends_the_session_and_cancels_its_requests_once(
    address: str,
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        payload = msgspec.msgpack.encode({"n": 0})
        await peer.send(wire.encode(wire.Submit(1, [(1, "a", payload), (2, "b", payload)])))
        await eventually(lambda: len(engine.submitted) == 2)
        await peer.send(wire.encode(wire.Ping(3, 0.0)))  # 2 never came
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        await eventually(lambda: len(engine.cancelled) == 2)
        assert {c.reason for c in engine.cancelled} == {"front_lost"}
        assert engine.server.stats().fronts == 0
        assert engine.server.in_flight == 0


async def test_a_front_that_says_hello_again_has_its_old_requests_cancelled_once(
    address: str,
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        payload = msgspec.msgpack.encode({"n": 0})
        await peer.send(wire.encode(wire.Submit(1, [(1, "a", payload)])))
        await eventually(lambda: len(engine.submitted) == 1)
        welcome = await say_hello(peer, attempt=2)
        assert welcome.attempt == 2
        await eventually(lambda: len(engine.cancelled) == 1)
        await peer.send(wire.encode(wire.Abort(1, [1])))  # the old submission: late, not twice
        await eventually(lambda: engine.server.stats().late_aborts == 1)
        assert len(engine.cancelled) == 1


async def test_an_undecodable_request_fails_alone_with_400(address: str) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        good = msgspec.msgpack.encode({"n": 1})
        await peer.send(wire.encode(wire.Submit(1, [(1, "bad", b"\xc1"), (2, "good", good)])))
        replies = [await answer(peer), await answer(peer)]
        failures = [f for r in replies if isinstance(r, wire.Step) for f in r.failures]
        outputs = [o for r in replies if isinstance(r, wire.Step) for o in r.outputs]
        assert [(sid, status) for sid, _, status in failures] == [(1, 400)]
        assert [(sid, finished) for sid, _, finished in outputs] == [(2, True)]


async def test_a_front_drops_malformed_frames_from_the_engine(address: str) -> None:
    junk = [b"\xc1", b"\x93\x63\x00\x00"]
    async with fake_engine(address, before=junk) as bound, front(bound, ready=False) as client:
        async with asyncio.timeout(10):
            await client.wait_ready()
        assert client.stats().malformed >= 2  # (twice per hello it had to send)
        assert client.stats().malformed % 2 == 0


import tether_zmq  # noqa: E402  (the public names, next to the wire module above)
