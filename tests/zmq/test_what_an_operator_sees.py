"""What a throttled log still tells an operator: a loss that fails requests is never
hidden behind lines about harmless ones, and a peer's text never reaches an error
or a line unescaped."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import zmq
import zmq.asyncio

import tether_zmq._protocol as wire
from tether_zmq import PROTOCOL_VERSION
from tether_zmq._throttle import BURST

from .conftest import LogClock, eventually
from .linked import front
from .test_protocol import raw_peer

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
            while not client.ready:  # (a hello of each attempt, till one opens)
                identity, _ = await _hello(fake)
                with contextlib.suppress(TimeoutError):
                    await eventually(lambda: client.ready, timeout=0.2)
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
    async with asyncio.timeout(10):
        while True:
            identity, frame = await fake.recv_multipart()
            message = wire.decode(frame)
            if isinstance(message, wire.Hello):
                break
    welcome = wire.Welcome(0, PROTOCOL_VERSION, "engine", message.attempt, 1 << 20)
    await fake.send_multipart([identity, wire.encode(welcome)])
    return identity, message
