"""Hostile or confused peers: malformed and oversized frames, version mismatches,
sequence gaps, messages without a session. Each is counted and dropped (or ends that
one session), and the loops keep serving the honest fronts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Final

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


AnswerHello = Callable[[zmq.asyncio.Socket, bytes, wire.Hello], Awaitable[None]]
"""How a fake engine answers a hello: ``answer(fake, identity, hello)``."""


@contextlib.asynccontextmanager
async def fake_engine(address: str, answer_hello: AnswerHello) -> AsyncIterator[str]:
    """A fake engine bound to ``address`` calling ``answer_hello`` for every hello (a
    front says hello again until answered); yields the bound endpoint."""
    async with raw_peer(zmq.ROUTER, address) as fake:

        async def serve() -> None:
            while True:
                identity, frame = await fake.recv_multipart()
                message = wire.decode(frame)
                if isinstance(message, wire.Hello):
                    await answer_hello(fake, identity, message)

        task = asyncio.create_task(serve())
        try:
            yield fake.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def welcome_with(*, version: int = PROTOCOL_VERSION, before: list[bytes] = ()) -> AnswerHello:
    """Welcome every hello with ``version``, sending the frames ``before`` first."""

    async def welcome(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        for junk in before:
            await fake.send_multipart([identity, junk])
        welcome = wire.Welcome(0, version, "fake", hello.attempt, 1 << 20)
        await fake.send_multipart([identity, wire.encode(welcome)])

    return welcome


def refuse_with(version: int) -> AnswerHello:
    """Refuse every hello as a real engine of protocol ``version`` does."""
    reason = f"protocol version {PROTOCOL_VERSION} is not {version}"
    refuse = wire.encode(wire.Refuse(0, version, reason))

    async def refuse_hello(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        await fake.send_multipart([identity, refuse])

    return refuse_hello


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
        fake_engine(address, welcome_with(version=PROTOCOL_VERSION + 1)) as bound,
        front(bound, ready=False) as client,
    ):
        await eventually(lambda: client.stats().refused >= 1)
        assert not client.ready
        with pytest.raises(tether_zmq.EngineUnavailable, match="protocol"):
            client.open({"n": 1})


@pytest.mark.parametrize("answer_with", ["welcome", "refuse"])
async def test_a_front_of_another_version_logs_it_once_however_often_it_says_hello(
    address: str, answer_with: str, caplog: pytest.LogCaptureFixture
) -> None:
    other = PROTOCOL_VERSION + 1
    answering = welcome_with(version=other) if answer_with == "welcome" else refuse_with(other)
    async with fake_engine(address, answering) as bound, front(bound, ready=False) as client:
        await eventually(lambda: client.stats().refused >= 10)  # (a hello per 0.1 s)
        with pytest.raises(tether_zmq.EngineUnavailable, match="protocol"):
            client.open({"n": 1})
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "protocol" in errors[0].getMessage()


async def test_an_engine_logs_hellos_of_another_version_once_a_period_not_once_each(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        for attempt in range(1, 51):
            hello = wire.Hello(0, PROTOCOL_VERSION + 1, "future\nforged line", attempt, 1 << 20)
            await peer.send(wire.encode(hello))
            assert isinstance(await answer(peer), wire.Refuse)
        assert engine.server.stats().refused == 50
        await assert_still_serves(engine.server)
    lines = [r.getMessage() for r in caplog.records if "speaks protocol" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0]  # (a peer's name is quoted, never a line of its own)


async def test_a_front_whose_hello_is_too_large_stays_down_and_says_why(address: str) -> None:
    async with greeted_engine(address) as (client, send, _):
        reason = f"{wire.HELLO_TOO_LARGE}: 20000 bytes (at most 16384)"
        await send(wire.Refuse(0, PROTOCOL_VERSION, reason))
        await eventually(lambda: client.stats().refused == 1)
        assert not client.ready
        with pytest.raises(tether_zmq.EngineUnavailable, match="hello too large"):
            client.open({"n": 1})


def _padded_ping(fields: int) -> bytes:
    """A ``Ping`` whose array declares ``fields`` fields: its own three, then nils."""
    return b"\xdd" + fields.to_bytes(4, "big") + b"\x07\x00\xcb" + bytes(8) + b"\xc0" * (fields - 3)


async def test_a_message_with_a_few_fields_past_its_own_is_read_for_a_newer_peer(
    address: str,
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(_padded_ping(wire.MAX_FIELDS))  # (no session: answered "say hello")
        assert isinstance(await answer(peer), wire.Refuse)
        assert engine.server.stats().no_session == 1
        assert engine.server.stats().malformed == 0


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"\xc1"], id="not-msgpack"),
        pytest.param([b"\x93\x63\x00\x00"], id="unknown-tag"),
        pytest.param([msgspec.msgpack.encode([4, 0, "not a list"])], id="wrong-field-type"),
        pytest.param([b"a", b"b"], id="two-frames"),
        pytest.param([b""], id="empty"),
        pytest.param([_padded_ping(wire.MAX_FIELDS + 1)], id="fields-past-the-cap"),
        # (a million fields for msgspec to skip one by one: refused from the header)
        pytest.param([_padded_ping(1 << 20)], id="a-million-fields"),
    ],
)
async def test_a_malformed_frame_is_counted_and_dropped(address: str, frames: list[bytes]) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)  # (a peer with no session has no more than a hello read)
        await peer.send_multipart(frames)
        await eventually(lambda: engine.server.stats().malformed == 1)
        await assert_still_serves(engine.server)


_MANY: Final = 1 << 22
"""Elements of a hostile frame's padding: 4 MiB of them, each one byte."""


def _array32(length: int) -> bytes:
    return b"\xdd" + length.to_bytes(4, "big")


def _padding(shape: str) -> bytes:
    """One value of millions of elements, a byte each: what msgspec would walk."""
    if shape == "array":
        return _array32(_MANY) + b"\xc0" * _MANY
    if shape == "map":
        return b"\xdf" + (_MANY // 2).to_bytes(4, "big") + b"\xc0" * _MANY
    return b"\x91" * _MANY + b"\xc0"  # (an array in an array in an array ...)


_SHAPES: Final = ["array", "map", "nesting"]


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"\x94\x07\x00\xcb" + bytes(8), id="ping"),
        pytest.param(b"\x94\x04\x01\x90", id="submit"),
        pytest.param(
            b"\x97" + wire.encode(wire.Hello(0, PROTOCOL_VERSION, "h", 1, 1 << 20))[1:], id="hello"
        ),
    ],
)
async def test_a_field_past_a_messages_own_that_is_no_scalar_is_refused_unread(
    address: str, head: bytes, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)  # (a peer with no session has no more than a hello read)
        await peer.send(head + _padding(shape))
        await eventually(lambda: engine.server.stats().malformed == 1)
        await assert_still_serves(engine.server)
        stats = engine.server.stats()
        assert (stats.no_session, stats.refused, stats.fronts_lost) == (0, 0, 0)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # (refused quietly)


def _least_time(decode: Callable[[bytes], object], frame: bytes) -> float:
    """The least of a few timings of ``decode(frame)``, raising or not (a shared
    machine's noise only ever adds)."""
    least = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        with contextlib.suppress(msgspec.DecodeError, wire.TooManyEntries):
            decode(frame)
        least = min(least, time.perf_counter() - started)
    return least


_PADDED_STEP: Final = b"\x94\x06\x01"  # (a Step's tag and seq, then its two lists)
_ENTRY: Final = b"\x93\x01\xc4\x00\xc2"  # (submission 1, no bytes, not finished)


@pytest.mark.parametrize(
    ("decode", "hostile"),
    [
        pytest.param(
            wire.decode_at_front,
            lambda: _PADDED_STEP + _padding("array") + b"\x90",
            id="front-outputs-of-millions",
        ),
        pytest.param(
            wire.decode_at_front,
            lambda: _PADDED_STEP + b"\x90" + _padding("array"),
            id="front-failures-of-millions",
        ),
        pytest.param(
            wire.decode_at_front,
            lambda: (
                _PADDED_STEP
                + b"\x91\xdd"
                + (3 + _MANY).to_bytes(4, "big")
                + _ENTRY[1:]
                + b"\xc0" * _MANY
                + b"\x90"
            ),
            id="front-an-output-of-millions-of-fields",
        ),
        pytest.param(
            wire.decode_at_front,
            lambda: b"\x95\x06\x01\x90\x90" + _padding("map"),
            id="front-a-step-with-a-field-of-millions",
        ),
        pytest.param(
            wire.decode_at_engine,
            lambda: b"\x94\x07\x00\xcb" + bytes(8) + _padding("array"),
            id="engine-a-ping-with-a-field-of-millions",
        ),
        pytest.param(
            wire.decode_at_engine,
            lambda: (
                b"\x93\x04\x01\x91\xdd"
                + (3 + _MANY).to_bytes(4, "big")
                + b"\x01\xa1r\xc4\x00"
                + b"\xc0" * _MANY
            ),
            id="engine-a-request-of-millions-of-fields",
        ),
    ],
)
def test_a_nested_padded_frame_costs_no_more_than_its_size(
    decode: Callable[[bytes], object], hostile: Callable[[], bytes]
) -> None:
    frame = hostile()
    honest = wire.encode(wire.Step(1, [(1, bytes(len(frame)), False)], []))
    if decode is wire.decode_at_engine:
        honest = wire.encode(wire.Submit(1, [(1, "r", bytes(len(frame)))]))
    with pytest.raises((msgspec.DecodeError, wire.TooManyEntries)):
        decode(frame)
    # (skipped element by element, 4M of them took 12-20 ms here, 3-5 ms per MiB, where
    # an honest frame of the same size, one payload, took 0.1-1 ms per MiB)
    assert _least_time(decode, frame) < _least_time(decode, honest) + 0.005


_COSTLY_TEXT: Final = "x" * _MANY + "\U0001f600"
"""4 MiB of text that costs 3-4 ms per MiB to decode, four times its bytes in memory
(one character past ASCII at its end makes every one of them four bytes wide)."""


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(
            wire.encode(wire.Submit(1, [(1, _COSTLY_TEXT, b"\x80")])),
            id="a-submission-of-a-costly-rid",
        ),
        pytest.param(_padded_ping(1 << 20), id="a-million-fields"),
    ],
)
async def test_a_peer_without_a_session_has_no_more_than_a_hello_read(
    address: str, frame: bytes
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(frame)
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert reply.reason == "no session: say hello"
        stats = engine.server.stats()
        assert (stats.no_session, stats.malformed, stats.refused) == (1, 0, 0)
        await say_hello(peer)  # (a hello is read, and opens a session)
        await assert_still_serves(engine.server)


async def test_a_hello_too_large_to_read_is_refused_unread_saying_so(address: str) -> None:
    hello = wire.encode(wire.Hello(0, PROTOCOL_VERSION, _COSTLY_TEXT, 1, 1 << 20))
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(hello)
        reply = await answer(peer)
        # (not "say hello": the front would say this one again for ever, never told why)
        assert isinstance(reply, wire.Refuse)
        assert reply.reason.startswith(wire.HELLO_TOO_LARGE), reply.reason
        assert str(len(hello)) in reply.reason
        stats = engine.server.stats()
        assert (stats.no_session, stats.malformed, stats.refused) == (0, 1, 0)
        await say_hello(peer)
        await assert_still_serves(engine.server)


async def test_a_newer_peers_scalar_fields_past_a_messages_own_are_read(address: str) -> None:
    extras = msgspec.msgpack.encode(7) + b"\xc3" + msgspec.msgpack.encode("trace")
    extras += msgspec.msgpack.encode(0.5)
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        hello = wire.encode(wire.Hello(0, PROTOCOL_VERSION, "newer", 1, 1 << 20))
        await peer.send(b"\x9a" + hello[1:] + extras)
        assert isinstance(await answer(peer), wire.Welcome)
        submit = wire.encode(wire.Submit(1, [(1, "r", msgspec.msgpack.encode({"n": 1}))]))
        await peer.send(b"\x97" + submit[1:] + extras)
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, finished) for sid, _, finished in reply.outputs] == [(1, True)]
        assert engine.server.stats().malformed == 0


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
    junk = [b"\xc1", b"\x93\x63\x00\x00", _padded_ping(1 << 20)]
    async with (
        fake_engine(address, welcome_with(before=junk)) as bound,
        front(bound, ready=False) as client,
    ):
        async with asyncio.timeout(10):
            await client.wait_ready()
        assert client.stats().malformed >= 3  # (three times per hello it had to send)
        assert client.stats().malformed % 3 == 0


@pytest.mark.parametrize(
    ("name", "cap", "why"),
    [
        pytest.param("x" * 129, 1 << 20, "name", id="name-too-long"),
        pytest.param("\u00e9" * 65, 1 << 20, "name", id="name-too-long-in-bytes"),
        pytest.param("tiny", 0, "max_message", id="cap-zero"),
        pytest.param("tiny", -(2**63), "max_message", id="cap-negative"),
        pytest.param("tiny", 1023, "max_message", id="cap-too-small"),
    ],
)
async def test_a_hello_no_session_could_serve_is_refused_aloud(
    address: str, name: str, cap: int, why: str
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(wire.encode(wire.Hello(0, PROTOCOL_VERSION, name, 1, cap)))
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert why in reply.reason
        assert engine.server.stats().fronts == 0
        await assert_still_serves(engine.server)


async def test_an_engine_that_says_what_a_request_is_refuses_a_costly_payload_unbuilt(
    address: str,
) -> None:
    # (3M empty lists: decoded as Any, about a second of the engine's loop)
    costly = msgspec.msgpack.encode([[]] * 3_000_000)
    codec = wire.MsgpackCodec(decodes=dict[str, int])
    async with (
        echo_engine(address, codec=codec) as engine,
        front(engine.server.address, engine_timeout=0.5) as client,
        raw_peer(zmq.DEALER, engine.server.address) as peer,
    ):
        await say_hello(peer)
        await peer.send(wire.encode(wire.Submit(1, [(1, "costly", costly)])))
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, status) for sid, _, status in reply.failures] == [(1, 400)]
        async with asyncio.timeout(10):
            assert await client.open({"n": 1}).result() == {"i": 1, "front": client.incarnation}
        assert client.stats().links_lost == 0
        assert engine.server.stats().submitted == 1  # (the honest front's)


async def test_a_message_for_the_other_direction_is_refused_unread_and_holds_no_loop(
    address: str,
) -> None:
    # (a Step is engine-to-front: sent to the engine, its millions of entries would be
    # built in full before being dropped, seconds of the engine's loop)
    flood = wire.encode(wire.Step(0, [(1, b"", False)] * 4_000_000, []))
    async with (
        echo_engine(address, max_message=len(flood)) as engine,
        front(engine.server.address, engine_timeout=0.5) as client,
        raw_peer(zmq.DEALER, engine.server.address) as peer,
    ):
        await say_hello(peer)  # (a peer with no session has no more than a hello read)
        waiting = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        await peer.send(flood)
        await eventually(lambda: engine.server.stats().malformed == 1)
        async with asyncio.timeout(10):
            assert await client.open({"n": 1}).result() == {"i": 1, "front": client.incarnation}
        engine.server.send([(engine.submitted[0], "kept", True)])
        async with asyncio.timeout(10):
            assert await waiting.result() == "kept"
        assert client.stats().links_lost == 0
        assert engine.server.stats().no_session == 0


_Send = Callable[[wire.Message | bytes], Awaitable[None]]


@contextlib.asynccontextmanager
async def greeted_engine(
    address: str,
) -> AsyncIterator[tuple[tether_zmq.EngineClient, _Send, wire.Hello]]:
    """A front that said hello to a fake engine, its hello, and a way to answer it
    anything."""
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False) as client:
            async with asyncio.timeout(10):
                identity, frame = await fake.recv_multipart()
            hello = wire.decode(frame)
            assert isinstance(hello, wire.Hello)

            async def send(message: wire.Message | bytes) -> None:
                frame = message if isinstance(message, bytes) else wire.encode(message)
                await fake.send_multipart([identity, frame])

            yield client, send, hello


@contextlib.asynccontextmanager
async def dishonest_engine(address: str) -> AsyncIterator[tuple[tether_zmq.EngineClient, _Send]]:
    """A front with a session on a fake engine, and a way to send it anything."""
    async with greeted_engine(address) as (client, send, hello):
        await send(wire.Welcome(0, PROTOCOL_VERSION, "fake", hello.attempt, 1 << 24))
        async with asyncio.timeout(10):
            await client.wait_ready()
        yield client, send


@pytest.mark.parametrize("cap", [0, -1, wire.MIN_MESSAGE - 1])
async def test_a_welcome_whose_cap_no_request_could_fit_opens_no_session(
    address: str, cap: int
) -> None:
    async with greeted_engine(address) as (client, send, hello):
        await send(wire.Welcome(0, PROTOCOL_VERSION, "fake", hello.attempt, cap))
        await eventually(lambda: client.stats().malformed == 1)
        assert not client.ready
        with pytest.raises(tether_zmq.EngineUnavailable, match="max_message"):
            client.open({"n": 1})
        assert client.registry.in_flight == 0


async def test_a_failure_text_from_the_engine_is_cut_before_a_client_sees_it(
    address: str,
) -> None:
    async with dishonest_engine(address) as (client, send):
        stream = client.open({"n": 1})
        await send(wire.Step(1, [], [(1, "\u00e9" * 1_000_000, 400)]))
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        shown = tether.http.error_response(caught.value)
        assert shown.status == 400
        message = shown.body["error"]["message"]
        assert message.endswith(": " + "\u00e9" * (wire.MAX_FAILURE_TEXT // 2))  # (whole chars)
        assert str(caught.value.__cause__) == "\u00e9" * (wire.MAX_FAILURE_TEXT // 2)


@pytest.mark.parametrize("shape", _SHAPES)
async def test_a_step_with_a_field_past_its_own_that_is_no_scalar_is_refused_unread(
    address: str, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with dishonest_engine(address) as (client, send):
        stream = client.open({"n": 1})
        step = wire.encode(wire.Step(1, [(1, msgspec.msgpack.encode("out"), True)], []))
        await send(b"\x95" + step[1:] + _padding(shape))
        await eventually(lambda: client.stats().malformed == 1)
        assert client.stats().outputs == 0  # (none of its entries was read)
        await send(wire.Step(1, [(1, msgspec.msgpack.encode("honest"), True)], []))
        async with asyncio.timeout(10):
            assert await stream.result() == "honest"
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("outputs", "failures"),
    [
        pytest.param(2_000_000, 0, id="outputs"),
        pytest.param(0, 2_000_000, id="failures"),
        pytest.param(10, 2_000_000, id="failures-after-outputs"),
    ],
)
async def test_a_step_of_more_entries_than_one_message_may_hold_ends_the_session_unread(
    address: str, outputs: int, failures: int
) -> None:
    async with dishonest_engine(address) as (client, send):
        stream = client.open({"n": 1})
        await send(wire.Step(1, [(1, b"", False)] * outputs, [(1, "", 400)] * failures))
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert isinstance(caught.value.__cause__, tether_zmq.EngineLost)
        assert f"a message of {outputs + failures} entries" in str(caught.value.__cause__)
        stats = client.stats()
        assert stats.malformed == 1
        assert stats.late_outputs == 0  # (none of its entries was read)
        assert stats.links_lost == 1
        assert client.registry.in_flight == 0


# A Step of too many entries is measured by walking its outputs' headers ("a few ms of
# walking, once, as the session ends", decode_at_front). A front with no session (down:
# its hello refused, say) ends nothing, so it must not walk every such frame again.
HOSTILE_FRAMES: Final = 40


async def test_a_step_of_too_many_entries_sent_to_a_front_without_a_session_is_walked_at_most_once(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[int] = []
    walk = wire._step_entries  # noqa: SLF001

    def counted(frame: bytes | memoryview) -> int:
        walks.append(1)
        return walk(frame)

    monkeypatch.setattr(wire, "_step_entries", counted)
    # 4096 outputs that msgspec builds, then a failures list one past the cap: refused at
    # the failures' header, then the 4096 outputs walked in Python to count the entries.
    hostile = wire.encode(
        wire.Step(
            1, [(1, b"x" * 8, False)] * wire.MAX_ENTRIES, [(1, "", 400)] * (wire.MAX_ENTRIES + 1)
        )
    )
    async with greeted_engine(address) as (client, send, _):
        reason = f"{wire.HELLO_TOO_LARGE}: 20000 bytes (at most 16384)"
        await send(wire.Refuse(0, PROTOCOL_VERSION, reason))
        await eventually(lambda: client.stats().refused == 1)
        assert not client.ready
        before = client.stats().malformed
        started = time.perf_counter()
        for _ in range(HOSTILE_FRAMES):
            await send(hostile)
        await eventually(lambda: client.stats().malformed >= before + HOSTILE_FRAMES)
        spent = time.perf_counter() - started
        assert not client.ready
    per_frame = 1e3 * spent / HOSTILE_FRAMES
    assert len(walks) <= 1, (
        f"a front without a session walked {len(walks)} of {HOSTILE_FRAMES} hostile Steps' headers "
        f"({per_frame:.2f} ms a frame, including the wire): the walk tells only a session "
        "that ends, and none does"
    )


@pytest.mark.parametrize(
    ("outputs", "failures"),
    [(0, wire.MAX_ENTRIES + 1), (7, wire.MAX_ENTRIES), (3000, 3000)],
    ids=["failures", "failures-after-outputs", "both-together"],
)
def test_a_front_measures_a_steps_outputs_and_failures_together(
    outputs: int, failures: int
) -> None:
    step = wire.Step(1, [(1, b"\x01", True)] * outputs, [(2, "no", 400)] * failures)
    with pytest.raises(wire.TooManyEntries) as caught:
        wire.decode_at_front(wire.encode(step))
    assert caught.value.count == outputs + failures


@pytest.mark.parametrize("decode", [wire.decode_at_engine, wire.decode_at_front])
def test_a_frame_of_more_fields_than_max_fields_is_refused_from_its_header(
    decode: Callable[[bytes], object],
) -> None:
    # (the array says a million fields; only a Ping's own follow: a decoder that read
    # past the header would fail on the truncation instead)
    frame = _array32(1 << 20) + b"\x07\x00\xcb" + bytes(8)
    with pytest.raises(msgspec.ValidationError, match=f"at most length {wire.MAX_FIELDS}"):
        decode(frame)


_MiB: Final = 1 << 20
_RID: Final = "x" * (4 * 1024) + "\U0001f600"
"""A request id a peer with a session may send: one character past the BMP at its end
makes every character of it four bytes wide (the costly strings the docs bound)."""


def _costly_submit(*, bad: bool = False, extra: bytes = b"") -> bytes:
    """A Submit of 4096 costly rids (about 16 MiB); ``bad``: the last entry's payload is
    an int (a wrong type in a known field, at the frame's very end); ``extra``: encoded
    fields past the message's own (a newer peer's)."""
    entries = [(sid, _RID, b"") for sid in range(1, wire.MAX_ENTRIES + 1)]
    frame = wire.encode(wire.Submit(1, entries))
    if bad:
        assert frame.endswith(b"\xc4\x00")
        frame = frame[:-2] + b"\x05"
    if extra:
        assert frame[0] == 0x93
        frame = b"\x94" + frame[1:] + extra
    return frame


def _costly_step(*, bad: bool = False, extra: bytes = b"", n: int = wire.MAX_ENTRIES) -> bytes:
    """A Step of ``n`` failures with costly texts (4096: about 16 MiB, a hostile or buggy
    engine's, which the front cuts only once built); ``bad``: the last failure's status
    is a float, at the frame's very end."""
    failures = [(sid, _RID, 500) for sid in range(1, n + 1)]
    frame = wire.encode(wire.Step(1, [], failures))
    if bad:
        assert frame.endswith(b"\xcd\x01\xf4")
        frame = frame[:-3] + b"\xcb" + msgspec.msgpack.encode(500.5)[1:]
    if extra:
        assert frame[0] == 0x94
        frame = b"\x95" + frame[1:] + extra
    return frame


def _costly_submit_of_one(*, bad: bool = False, extra: bytes = b"") -> bytes:
    """A Submit of one request whose rid is 16 MiB of costly text (the docs' bound on
    strings from a peer with a session: 3-4 ms per MiB); ``bad`` and ``extra`` as above."""
    frame = wire.encode(wire.Submit(1, [(1, "x" * (16 * _MiB) + "\U0001f600", b"")]))
    if bad:
        frame = frame[:-2] + b"\x05"
    if extra:
        frame = b"\x94" + frame[1:] + extra
    return frame


def _step_of_outputs(*, bad: bool = False, extra: bytes = b"") -> bytes:
    """A Step of 4095 small outputs and one failure (about 40 KiB, cheap to decode);
    ``bad``: that failure's status is a float, at the frame's very end."""
    outputs = [(sid, b"\x01", False) for sid in range(1, wire.MAX_ENTRIES)]
    frame = wire.encode(wire.Step(1, outputs, [(1, "no", 500)]))
    if bad:
        frame = frame[:-3] + b"\xcb" + msgspec.msgpack.encode(500.5)[1:]
    if extra:
        frame = b"\x95" + frame[1:] + extra
    return frame


_COSTLY_FRAMES: Final = [
    pytest.param(wire.decode_at_engine, _costly_submit, id="engine-a-submit"),
    pytest.param(wire.decode_at_engine, _costly_submit_of_one, id="engine-a-submit-of-one-rid"),
    pytest.param(wire.decode_at_front, _costly_step, id="front-a-step"),
    pytest.param(wire.decode_at_front, _step_of_outputs, id="front-a-step-of-outputs"),
]


def _reader_of(decode: Callable[[bytes], object]) -> wire._Reader:
    return wire._engine_reader if decode is wire.decode_at_engine else wire._front_reader  # noqa: SLF001


@pytest.mark.parametrize(("decode", "make"), _COSTLY_FRAMES)
def test_a_frame_refused_for_a_bad_field_is_read_once(
    decode: Callable[[bytes], object], make: Callable[..., bytes]
) -> None:
    honest, broken = make(), make(bad=True)
    assert abs(len(honest) - len(broken)) < 16
    decode(honest)
    # (a wrong type in a known field is no newer peer's field: reading the frame again
    # with room for more fields would fail at the same place, at twice the cost; 669c7a7
    # did: 16 MiB of costly rids, honest 32-36 ms, broken 65-72 ms)
    with _reads_of(_reader_of(decode), least=0) as reads, pytest.raises(msgspec.ValidationError):
        decode(broken)
    assert len(reads) == 1, reads


@pytest.mark.parametrize(("decode", "make"), _COSTLY_FRAMES)
def test_a_newer_peers_frame_is_read_once(
    decode: Callable[[bytes], object], make: Callable[..., bytes]
) -> None:
    newer = make(extra=msgspec.msgpack.encode("trace-id"))
    # (msgspec checks an array-like struct's maximum length only after reading every
    # field it knows: trying the exact fields first read a newer peer's frame twice)
    with _reads_of(_reader_of(decode), least=0) as reads:
        decode(newer)  # (read, as promised)
    assert len(reads) == 1, reads


async def test_a_newer_fronts_hello_with_a_long_scalar_field_is_welcomed(address: str) -> None:
    # A newer front of the same protocol version adds a string to its hello (a token, a
    # description of what it runs): a scalar, past the 1 KiB a peer without a session
    # may send of anything else.
    hello = wire.encode(wire.Hello(0, PROTOCOL_VERSION, "newer", 1, 1 << 20))
    assert hello[0] == 0x96
    newer = b"\x97" + hello[1:] + msgspec.msgpack.encode("t" * 1100)
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await peer.send(newer)
        reply = await answer(peer)
        assert isinstance(reply, wire.Welcome), reply
        await assert_still_serves(engine.server)


class _Counting:
    """A decoder that counts the frames of more than ``least`` bytes it reads (by
    default, pings and hellos are not)."""

    def __init__(
        self, decoder: msgspec.msgpack.Decoder[object], counts: list[int], least: int
    ) -> None:
        self._decoder = decoder
        self._counts = counts
        self._least = least

    def decode(self, frame: bytes) -> object:
        if len(frame) > self._least:
            self._counts.append(len(frame))
        return self._decoder.decode(frame)


@contextlib.contextmanager
def _reads_of(reader: wire._Reader, *, least: int = _MiB) -> Iterator[list[int]]:
    """Every large frame ``reader`` walks, strictly or with its twins (its private
    decoders are what is counted)."""
    counts: list[int] = []
    strict, twins = reader._strict, reader._twins  # noqa: SLF001
    counting = _Counting(strict, counts, least), _Counting(twins, counts, least)
    reader._strict, reader._twins = counting  # type: ignore[assignment]  # noqa: SLF001
    try:
        yield counts
    finally:
        reader._strict, reader._twins = strict, twins  # noqa: SLF001


async def test_a_frame_refused_for_a_bad_field_is_read_once_by_the_engine(address: str) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        reader = wire._engine_reader  # noqa: SLF001
        with _reads_of(reader) as reads:
            await peer.send(_costly_submit_of_one(bad=True))  # (seq 1: the session's next)
            await eventually(lambda: engine.server.stats().malformed == 1)
        # (read twice, the whole 16 MiB rid, four times that in memory, was built, thrown
        # away and built again: a 32 MiB frame held the loop 135-147 ms, an honest 66-75)
        assert len(reads) == 1, reads
        await assert_still_serves(engine.server)


async def test_a_step_refused_for_a_bad_field_is_read_once_by_the_front(address: str) -> None:
    async with dishonest_engine(address) as (client, send):
        reader = wire._front_reader  # noqa: SLF001
        with _reads_of(reader) as reads:
            await send(_costly_step(bad=True, n=2048))  # (8 MiB: within the front's cap)
            await eventually(lambda: client.stats().malformed == 1)
        assert len(reads) == 1, reads


async def test_an_engines_name_costs_a_front_no_more_than_a_fronts_name_costs_the_engine(
    address: str,
) -> None:
    # (the engine refuses a hello whose front name is past MAX_NAME bytes; a front keeps
    # no more of the engine's name for its session: a 1 MiB name past the BMP would be
    # kept four times over, for as long as the front runs)
    async with greeted_engine(address) as (client, send, hello):
        name = "x" * _MiB + "\U0001f600"
        await send(wire.Welcome(0, PROTOCOL_VERSION, name, hello.attempt, 1 << 24))
        async with asyncio.timeout(10):
            await client.wait_ready()  # (a name is for logs: a long one is cut, not refused)
        kept = client._engine  # noqa: SLF001 (what the session keeps)
        assert kept == "x" * wire.MAX_NAME


import tether  # noqa: E402
import tether.http  # noqa: E402
import tether_zmq  # noqa: E402  (the public names, next to the wire module above)
