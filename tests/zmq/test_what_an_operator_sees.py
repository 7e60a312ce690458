"""What a throttled log still tells an operator: a loss that fails requests is never
hidden behind lines about harmless ones, and a peer's text never reaches an error
or a line unescaped."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

import tether
import tether_zmq
import tether_zmq._protocol as wire
from tether import http
from tether_zmq import PROTOCOL_VERSION
from tether_zmq._throttle import BURST

from .conftest import LogClock, eventually
from .linked import echo_engine, front
from .test_protocol import answer, raw_peer, say_hello

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _still(log_clock: LogClock) -> LogClock:
    """However long a scene runs here, its throttles earn no line."""
    return log_clock


async def test_a_front_warns_of_a_link_loss_that_fails_requests_after_many_empty_ones(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An engine restarted again and again while idle (a crash loop at night), each
    # session lost with no request in flight; then a loss that fails a live request.
    # The engine splits its kinds (with requests: WARNING, without: INFO); the front
    # spends one throttle on both, so the loss that failed requests goes unsaid.
    empty = 3 * BURST
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        options = {"hello_interval": 0.02, "ping_interval": 0.002}
        async with front(bound, ready=False, **options) as client:
            for _ in range(empty):
                identity, _ = await _hello(fake)
                await fake.send_multipart([identity, _GAP])
            await eventually(lambda: client.stats().links_lost >= empty)
            identity = await _welcomed(fake, client)
            stream = client.open({"n": 1})
            await fake.send_multipart([identity, _GAP])
            await eventually(lambda: client.stats().failed_on_loss >= 1)
            stream.cancel()
    failing = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "failing 1 requests" in r.getMessage()
    ]
    assert failing, "no line says that a loss failed a live request"


_GAP = wire.encode(wire.Ping(7, 0.0))
"""A frame out of sequence: the session it reaches ends."""


async def _hello(fake: zmq.asyncio.Socket) -> tuple[bytes, wire.Hello]:
    """Wait for the next hello and welcome it."""
    identity, message = await _next_hello(fake)
    welcome = wire.Welcome(0, PROTOCOL_VERSION, "engine", message.attempt, 1 << 20)
    await fake.send_multipart([identity, wire.encode(welcome)])
    return identity, message


async def _welcomed(fake: zmq.asyncio.Socket, client: tether_zmq.EngineClient) -> bytes:
    """Welcome the front's hellos until a session is up; the front's routing id."""
    while True:  # (a hello of each attempt, till one opens)
        identity, _ = await _hello(fake)
        with contextlib.suppress(TimeoutError):
            await eventually(lambda: client.ready, timeout=0.2)
            return identity


async def _submitted(fake: zmq.asyncio.Socket) -> int:
    """The id of the next submission the front sends (its pings pass by)."""
    async with asyncio.timeout(10):
        while True:
            _, frame = await fake.recv_multipart()
            message = wire.decode(frame)
            if isinstance(message, wire.Submit):
                return message.requests[0][0]


async def _to_the_end(stream: tether.Stream) -> None:
    async with asyncio.timeout(10):
        async for _ in stream:
            pass


async def test_an_engines_failure_text_never_forges_a_front_log_line(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A request the engine fails with a 5xx: the front's HTTP layer logs the cause
    # (the client sees no detail), and the cause's text is the engine's own.
    forged = "boom\n2026-12-05 23:00:00 CRITICAL tether: forged by the engine\r"
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False, hello_interval=0.05) as client:
            identity = await _welcomed(fake, client)
            stream = client.open({"n": 1})
            sid = await _submitted(fake)
            step = wire.Step(1, [], [(sid, forged, 500)])
            await fake.send_multipart([identity, wire.encode(step)])
            with pytest.raises(tether.ProducerError) as caught:
                await _to_the_end(stream)
            http.error_response(caught.value)  # (what the front's handler answers)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    rendered = "\n".join(formatter.format(record) for record in caplog.records)
    forgeries = [line for line in rendered.splitlines() if line.startswith("2026-12-05 23:00")]
    assert not forgeries, rendered


async def test_an_engine_warns_of_a_front_lost_with_requests_whatever_another_front_does(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Any peer that can connect opens a session, submits, and breaks it, again and
    # again: each a WARNING "lost ... cancelling its 1 requests" that spends the one
    # throttle every front's losses share. Then a real front is lost with a request
    # live: the operator must hear of it, not only of the peer cycling its sessions.
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        for attempt in range(1, 3 * BURST):
            await say_hello(peer, attempt)
            submit = wire.Submit(1, [(attempt, "r", msgspec.msgpack.encode({"n": 0}))])
            await peer.send(wire.encode(submit))
            await peer.send(_GAP)
            assert isinstance(await answer(peer), wire.Refuse)
        submitted = engine.server.stats().submitted
        async with front(engine.server.address) as client:
            stream = client.open({"n": 0})  # (it waits: the echo engine never ends it)
            await eventually(lambda: engine.server.stats().submitted > submitted)
            lost = engine.server.stats().fronts_lost
        await eventually(lambda: engine.server.stats().fronts_lost > lost)
        stream.cancel()
    honest = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and "cancelling its 1 requests" in r.getMessage()
        and "'raw'" not in r.getMessage()
    ]
    assert honest, "no line says the engine lost a real front with a request live"


async def test_a_front_opens_a_session_only_in_answer_to_a_hello_it_said(
    address: str,
) -> None:
    # A session that ends at once is followed by no hello until hello_interval has
    # passed; its attempt number is spent unsaid. A welcome naming that number answers
    # no hello, and a session it opened would start on the old session's counters.
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False, hello_interval=5.0, ping_interval=0.01) as client:
            identity, hello = await _hello(fake)
            await eventually(lambda: client.ready)
            await fake.send_multipart([identity, _GAP])
            await eventually(lambda: client.stats().links_lost == 1)
            unsaid = wire.Welcome(0, PROTOCOL_VERSION, "engine", hello.attempt + 1, 1 << 20)
            await fake.send_multipart([identity, wire.encode(unsaid)])
            malformed = client.stats().malformed
            await fake.send_multipart([identity, b"\xc1"])  # (read after the welcome)
            await eventually(lambda: client.stats().malformed > malformed)
            assert not client.ready, "a session opened in answer to no hello"


async def test_an_engine_that_drops_each_connection_it_welcomes_hears_a_hello_once_per_interval(
    ipc_dir: str,
) -> None:
    # hello_interval is "the least between two hellos": a broken engine that welcomes a
    # front and dies (a crash loop), or a hostile one that closes each connection it
    # welcomed, ends each session as it opens. The reconnect's handshake is no reason
    # to spin: each session there ended within hello_interval of its hello.
    address = f"ipc://{ipc_dir}/engine"
    interval = 0.5
    hellos: list[float] = []
    async with front(address, ready=False, hello_interval=interval, ping_interval=0.01) as client:
        for _ in range(4):
            async with raw_peer(zmq.ROUTER, address) as fake:
                await _hello(fake)
                hellos.append(time.monotonic())
                await eventually(lambda: client.ready)
            await eventually(lambda: not client.ready)
    gaps = [later - earlier for earlier, later in itertools.pairwise(hellos)]
    # (the front spaces its hellos by its clock; their arrivals here may bunch a little)
    assert min(gaps) > interval / 2, gaps


async def test_a_front_counts_as_unsaid_only_lines_it_would_have_said(
    address: str, caplog: pytest.LogCaptureFixture, log_clock: LogClock
) -> None:
    # A refused hello is logged once per reason. Once the throttle's burst is spent, a
    # reason refused again and again is one line held back, not one per hello: its
    # line, once let out, must not claim that dozens of lines like it went unsaid.
    async def refuse(fake: zmq.asyncio.Socket, reason: str) -> None:
        identity, _ = await _next_hello(fake)
        refusal = wire.Refuse(0, PROTOCOL_VERSION, f"{wire.HELLO_TOO_LARGE}: {reason}")
        await fake.send_multipart([identity, wire.encode(refusal)])

    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False, hello_interval=0.001) as client:
            for size in range(BURST):
                await refuse(fake, f"{1000 + size} bytes")
            for _ in range(20):
                await refuse(fake, "7 bytes")
            await eventually(lambda: client.stats().refused == BURST + 20)
            log_clock.advance(6.0)  # (one more line earned)
            await refuse(fake, "7 bytes")
            await eventually(lambda: client.stats().refused == BURST + 21)
    lines = [r.getMessage() for r in caplog.records if ": 7 bytes'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "more like it unsaid" not in lines[0] or "(and 1 more" in lines[0], lines


async def _next_hello(fake: zmq.asyncio.Socket) -> tuple[bytes, wire.Hello]:
    async with asyncio.timeout(10):
        while True:
            identity, frame = await fake.recv_multipart()
            message = wire.decode(frame)
            if isinstance(message, wire.Hello):
                return identity, message


async def test_a_link_loss_costs_a_bounded_number_of_lines_however_many_requests_it_fails(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # "What a peer can make an end log in all is bounded": the front's own line for a
    # loss is throttled, but each request it fails is answered through error_response,
    # which logs a 5xx cause at ERROR: one line per request, whatever the throttles.
    async with raw_peer(zmq.ROUTER, address) as fake:
        bound = fake.getsockopt_string(zmq.LAST_ENDPOINT)
        async with front(bound, ready=False, hello_interval=0.05) as client:
            identity = await _welcomed(fake, client)
            streams = [client.open({"n": 1}) for _ in range(100)]
            await fake.send_multipart([identity, _GAP])
            for stream in streams:
                with pytest.raises(tether.ProducerError) as caught:
                    await _to_the_end(stream)
                http.error_response(caught.value)  # (what the front's handler answers)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= BURST, f"{len(lines)} lines for one loss: {lines[:2]}"
