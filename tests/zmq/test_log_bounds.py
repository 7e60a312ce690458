"""What a peer can make the other end write to its log: a bounded number of lines,
whatever it sends, and never a line of the peer's own making."""

from __future__ import annotations

import itertools
import logging
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

import tether_zmq
import tether_zmq._protocol as wire  # the wire format itself is what these tests poke at
from tether_zmq import PROTOCOL_VERSION
from tether_zmq._throttle import BURST

from .conftest import LogClock, eventually
from .linked import echo_engine, front
from .test_protocol import answer, assert_still_serves, fake_engine, raw_peer, say_hello

pytestmark = pytest.mark.timeout(60)

_LINES = BURST
"""More log lines than any one of these scenes may make: each makes hundreds of
refusals, losses or sessions; an end that logs each one writes hundreds of lines. It is
the throttle's burst, all a kind of line gets while its clock stands still (below); at
most one more per ``PERIOD`` seconds after (tests/zmq/test_throttle.py)."""


@pytest.fixture(autouse=True)
def _still(log_clock: LogClock) -> LogClock:
    """However long a scene runs here (a loaded machine), its throttles earn no line."""
    return log_clock


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


@pytest.mark.parametrize(
    "then",
    [f"{wire.HELLO_TOO_LARGE}: 200 bytes (at most 100)", "no session: say hello"],
    ids=["too-large", "no-session"],
)
async def test_a_front_refused_for_two_reasons_in_turn_logs_each_reason_once(
    address: str, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Two refusals in turn (A, B, A, B, ...): a version mismatch, then a hello too large
    # (logged too) or "no session" (not logged, but it resets what was said): "one
    # ERROR per reason", not one per change of reason. Refusals carry no attempt, so
    # any engine can send as many as it likes for one hello.
    other = wire.Refuse(0, PROTOCOL_VERSION + 1, "protocol version is not ours")
    large = wire.Refuse(0, PROTOCOL_VERSION, then)

    async def refuse(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        for _ in range(100):
            await fake.send_multipart([identity, wire.encode(other)])
            await fake.send_multipart([identity, wire.encode(large)])

    async with fake_engine(address, refuse) as bound, front(bound, ready=False) as client:
        await eventually(lambda: client.stats().refused >= 200)
        with pytest.raises(tether_zmq.EngineUnavailable):
            client.open({"n": 1})
    errors = _lines(caplog, logging.ERROR)
    assert len(errors) <= 2, f"{len(errors)} ERROR lines for 2 reasons: {errors[:4]}"


async def test_a_front_logs_a_bounded_number_of_lines_whatever_reasons_an_engine_refuses_with(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each refusal names another size: each is "another reason" to a front that logs
    # once per reason, so each is a line.
    async def refuse(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        for size in range(200):
            reason = f"{wire.HELLO_TOO_LARGE}: {100 + size} bytes (at most 100)"
            await fake.send_multipart(
                [identity, wire.encode(wire.Refuse(0, PROTOCOL_VERSION, reason))]
            )

    async with fake_engine(address, refuse) as bound, front(bound, ready=False) as client:
        await eventually(lambda: client.stats().refused >= 200)
    errors = _lines(caplog, logging.ERROR)
    assert len(errors) <= _LINES, f"{len(errors)} ERROR lines: {errors[:3]}"


async def _cycle(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
    """A session that ends as it opens: a welcome, then a frame out of sequence."""
    welcome = wire.Welcome(0, PROTOCOL_VERSION, "cycling", hello.attempt, 1 << 20)
    await fake.send_multipart([identity, wire.encode(welcome)])
    await fake.send_multipart([identity, wire.encode(wire.Ping(7, 0.0))])


async def test_an_engine_ending_every_session_at_once_makes_a_front_log_a_bounded_number_of_lines(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Welcome, then a frame out of sequence: the session ends, the front says hello
    # again (after hello_interval: a millisecond here, for hundreds of sessions), and
    # the next session ends the same way.
    async with (
        fake_engine(address, _cycle) as bound,
        front(bound, ready=False, hello_interval=0.001, ping_interval=0.001) as client,
    ):
        await eventually(lambda: client.stats().links_lost >= 300)
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) <= _LINES, f"{len(warnings)} lines for 300 sessions: {warnings[:2]}"


@pytest.mark.parametrize("in_sequence", [True, False])
async def test_an_engines_refusal_text_never_forges_a_front_log_line(
    address: str, in_sequence: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tether.zmq")  # (a loss failing nothing: INFO)
    forged = "bye\n2026-12-05 23:00:00 CRITICAL tether_zmq: forged by the engine\r"

    async def end(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        if hello.attempt > 1:
            return
        welcome = wire.Welcome(0, PROTOCOL_VERSION, "engine\nforged", hello.attempt, 1 << 20)
        await fake.send_multipart([identity, wire.encode(welcome)])
        seq = 1 if in_sequence else 9
        await fake.send_multipart(
            [identity, wire.encode(wire.Refuse(seq, PROTOCOL_VERSION, forged))]
        )

    async with fake_engine(address, end) as bound, front(bound, ready=False) as client:
        await eventually(lambda: client.stats().links_lost >= 1)
    lines = _lines(caplog, logging.DEBUG)
    assert lines
    assert not [line for line in lines if "\n" in line or "\r" in line], lines


async def test_an_engine_logs_a_bounded_number_of_lines_for_a_front_that_says_hello_again_and_again(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tether.zmq")
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        for attempt in range(1, 301):
            await say_hello(peer, attempt)
        assert engine.server.stats().fronts_lost == 299
        await assert_still_serves(engine.server)
    lines = [line for line in _lines(caplog, logging.INFO) if "lost" in line]
    assert len(lines) <= _LINES, f"{len(lines)} lines for 300 hellos: {lines[:2]}"


_ENDINGS = {
    "gap": wire.Ping(9, 0.0),
    "too-many-entries": wire.Submit(2, [(sid, "r", b"") for sid in range(wire.MAX_ENTRIES + 1)]),
    "hello-again": None,
}


@pytest.mark.parametrize("ending", _ENDINGS)
async def test_an_engine_logs_a_bounded_number_of_warnings_for_a_front_that_ends_its_sessions(
    address: str, ending: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Hello, one request (it waits: {"n": 0}), then the session's end: a frame out of
    # sequence, a message of too many entries, or the next hello. Each session ends
    # with a live request, a WARNING each time.
    end = _ENDINGS[ending]
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        for attempt in range(1, 301):
            await say_hello(peer, attempt)
            submit = wire.Submit(1, [(attempt, "r", msgspec.msgpack.encode({"n": 0}))])
            await peer.send(wire.encode(submit))
            if end is not None:
                await peer.send(wire.encode(end))
                assert isinstance(await answer(peer), wire.Refuse)  # ("... say hello")
        # (a hello ends the session before it; the last one is still open)
        assert engine.server.stats().fronts_lost == (299 if end is None else 300)
        await assert_still_serves(engine.server)
    warnings = _lines(caplog, logging.WARNING)
    assert len(warnings) <= _LINES, f"{len(warnings)} WARNING lines: {warnings[:2]}"


async def test_an_engines_line_for_refused_versions_counts_the_hellos_it_left_unsaid(
    address: str, caplog: pytest.LogCaptureFixture, log_clock: LogClock
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:

        async def hellos(count: int) -> None:
            for attempt in range(count):
                hello = wire.Hello(0, PROTOCOL_VERSION + 1, "future", attempt, 1 << 20)
                await peer.send(wire.encode(hello))
                assert isinstance(await answer(peer), wire.Refuse)

        await hellos(1)
        await hellos(9)
        log_clock.advance(61.0)  # (a minute on)
        await hellos(1)
        assert engine.server.stats().refused == 11
    lines = [r.getMessage() for r in caplog.records if "speaks protocol" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "and 0 more" in lines[0], lines
    assert "and 9 more" in lines[1], lines


async def test_a_front_logs_an_engines_version_once_across_that_engines_restarts(
    ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An engine of another version restarted again and again (a supervisor's crash
    # loop, or a peer cycling its connection on purpose) says the same thing each time.
    address = f"ipc://{ipc_dir}/engine"
    refuse = wire.encode(wire.Refuse(0, PROTOCOL_VERSION + 1, "protocol version is not ours"))
    async with front(address, ready=False) as client:
        for restart in range(1, 21):
            async with raw_peer(zmq.ROUTER, address) as engine:
                identity, _ = await engine.recv_multipart()
                await engine.send_multipart([identity, refuse])
                await eventually(lambda restart=restart: client.stats().refused >= restart)
    errors = _lines(caplog, logging.ERROR)
    assert len(errors) <= 2, f"{len(errors)} ERROR lines for one reason: {errors[:2]}"


async def test_an_engine_ending_every_session_at_once_hears_a_hello_once_per_hello_interval(
    address: str,
) -> None:
    # Without a pause, such an engine spins its front (and itself): a hello, a session,
    # its end, a hello at once, thousands of times a second.
    interval = 0.05
    hellos: list[float] = []

    async def cycle(fake: zmq.asyncio.Socket, identity: bytes, hello: wire.Hello) -> None:
        hellos.append(time.monotonic())
        await _cycle(fake, identity, hello)

    async with (
        fake_engine(address, cycle) as bound,
        front(bound, ready=False, hello_interval=interval, ping_interval=0.005) as client,
    ):
        await eventually(lambda: client.stats().links_lost >= 5)
    gaps = [later - earlier for earlier, later in itertools.pairwise(hellos)]
    # (the front spaces its hellos by its clock; their arrivals here may bunch a little)
    assert min(gaps) > interval / 2, gaps
