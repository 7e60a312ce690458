"""Each submission is its own: a rid reused after an abort never meets the old
submission's outputs, a duplicate is refused aloud, and a request that breaks a size
limit fails alone, with sizes counted in bytes on the side that enforces them."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq

import tether
import tether.http
import tether_zmq._protocol as wire  # the hostile peers below speak the wire format itself
from tether_zmq import EngineServer, PayloadTooLarge, RemoteFailure, UnencodableRequest

from .conftest import eventually
from .linked import echo_engine, front
from .test_protocol import answer, raw_peer, say_hello

pytestmark = pytest.mark.timeout(60)


async def test_a_rid_reused_in_the_tick_of_its_abort_is_served_as_a_new_request(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        first = client.open({"n": 0}, rid="again")
        first.cancel()  # its abort leaves at the end of this tick ...
        second = client.open({"n": 2}, rid="again")  # ... after this submission
        async with asyncio.timeout(10):
            assert [output["i"] async for output in second] == [1, 2]
        await eventually(lambda: len(engine.cancelled) == 1)
        assert engine.cancelled[0].key == engine.submitted[0]
        assert engine.submitted[0] != engine.submitted[1]
        assert engine.server.in_flight == 0
        assert client.registry.in_flight == 0


async def test_output_of_an_aborted_submission_never_reaches_the_rid_reused_after_it(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        first = client.open({"n": 0}, rid="again")
        await eventually(lambda: len(engine.submitted) == 1)
        await first.aclose()
        await eventually(lambda: len(engine.cancelled) == 1)
        second = client.open({"n": 0}, rid="again")
        await eventually(lambda: len(engine.submitted) == 2)
        old, new = engine.submitted
        # A step that was already running for the aborted submission sends its output
        # late, then the newcomer's own output goes out.
        engine.server.send([(old, {"i": "old"}, True)])
        engine.server.send([(new, {"i": "new"}, True)])
        async with asyncio.timeout(10):
            assert await second.result() == {"i": "new"}
        assert engine.server.stats().late_outputs == 1
        assert client.registry.in_flight == 0


async def test_a_resubmitted_rid_supersedes_its_earlier_submission_in_the_engine(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0}, rid="mine")
        await eventually(lambda: len(engine.submitted) == 1)
        client.submit("mine", {"n": 0})  # (the application submits the same rid again)
        await eventually(lambda: len(engine.submitted) == 2 and len(engine.cancelled) == 1)
        old, new = engine.submitted
        assert engine.cancelled[0].key == old
        engine.server.send([(old, "stale", True), (new, "fresh", True)])
        async with asyncio.timeout(10):
            assert await stream.result() == "fresh"
        assert engine.server.in_flight == 0


async def test_a_duplicate_submission_is_refused_aloud_and_the_first_goes_on(
    address: str,
) -> None:
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        endless = msgspec.msgpack.encode({"n": 0})
        await peer.send(wire.encode(wire.Submit(1, [(7, "a", endless)])))
        await eventually(lambda: len(engine.submitted) == 1)
        await peer.send(wire.encode(wire.Submit(2, [(7, "a", endless), (3, "b", endless)])))
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, status) for sid, _, status in reply.failures] == [(7, 400), (3, 400)]
        assert engine.server.stats().refused_submissions == 2
        assert len(engine.submitted) == 1  # the first one, still running
        engine.server.send([(engine.submitted[0], {"i": 1}, True)])
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, finished) for sid, _, finished in reply.outputs] == [(7, True)]


async def test_a_request_over_the_engine_s_cap_fails_alone_with_413_and_the_others_go_on(
    address: str,
) -> None:
    # The front's own cap is the default (16 MiB): the engine's welcome tells it 4096.
    async with (
        echo_engine(address, max_message=4096) as engine,
        front(engine.server.address) as client,
    ):
        waiting = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        with pytest.raises(PayloadTooLarge) as caught:
            client.open({"n": 1, "pad": "é" * 3000})  # (3000 characters, 6000 bytes)
        assert tether.http.error_response(caught.value).status == 413
        assert client.registry.in_flight == 1
        engine.server.send([(engine.submitted[0], {"i": 1}, True)])
        async with asyncio.timeout(10):
            assert await waiting.result() == {"i": 1}
        assert client.ready
        assert client.stats().links_lost == 0
        assert client.stats().too_large == 1


async def test_a_front_that_ignores_the_cap_has_that_submission_refused_and_keeps_its_session(
    address: str,
) -> None:
    async with (
        echo_engine(address, max_message=4096) as engine,
        raw_peer(zmq.DEALER, engine.server.address) as peer,
    ):
        assert (await say_hello(peer)).max_message == 4096
        big = msgspec.msgpack.encode({"n": 1, "pad": "x" * 5000})
        await peer.send(wire.encode(wire.Submit(1, [(1, "big", big), (2, "small", b"\x80")])))
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, status) for sid, _, status in reply.failures] == [(1, 413), (2, 413)]
        await peer.send(
            wire.encode(wire.Submit(2, [(3, "next", msgspec.msgpack.encode({"n": 1}))]))
        )
        reply = await answer(peer)
        assert isinstance(reply, wire.Step)
        assert [(sid, finished) for sid, _, finished in reply.outputs] == [(3, True)]
        assert engine.server.stats().fronts == 1
        assert engine.server.stats().too_large == 1


async def test_steps_are_cut_to_the_front_s_cap_when_it_is_smaller_than_the_engine_s(
    address: str,
) -> None:
    async with (
        echo_engine(address) as engine,  # (16 MiB)
        front(engine.server.address, max_message=4096) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(40)]
        await eventually(lambda: len(engine.submitted) == 40)
        engine.server.send((key, "ü" * 200, True) for key in engine.submitted)
        async with asyncio.timeout(10):
            assert [await stream.result() for stream in streams] == ["ü" * 200] * 40
        assert client.stats().steps > 1
        assert client.stats().links_lost == 0


class Refusal(ValueError):
    status_code = 422


async def test_a_failure_of_non_ascii_text_is_cut_in_bytes_and_reaches_its_request(
    address: str,
) -> None:
    limit = 4096
    async with (
        echo_engine(address, max_message=limit) as engine,
        front(engine.server.address, max_message=limit) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(3)]
        await eventually(lambda: len(engine.submitted) == 3)
        text = "€" * 2000  # 2000 characters, 6000 bytes: more than one message holds
        engine.server.send(failures=[(key, Refusal(text)) for key in engine.submitted])
        async with asyncio.timeout(10):
            for stream in streams:
                with pytest.raises(tether.ProducerError) as caught:
                    await stream.result()
                cause = caught.value.__cause__
                assert isinstance(cause, RemoteFailure)
                assert cause.status_code == 422
                assert set(str(cause)) == {"€"}
                assert len(str(cause).encode()) <= 1024
        assert client.stats().links_lost == 0
        assert engine.server.in_flight == 0


async def test_a_message_of_more_entries_than_a_front_may_send_is_refused_unread(
    address: str,
) -> None:
    async with (
        echo_engine(address) as engine,
        front(engine.server.address) as honest,
        raw_peer(zmq.DEALER, engine.server.address) as peer,
    ):
        await say_hello(peer)
        flood = [(sid, "r", b"\x80") for sid in range(1, wire.MAX_ENTRIES + 2)]
        await peer.send(wire.encode(wire.Submit(1, flood)))
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert str(wire.MAX_ENTRIES) in reply.reason
        assert engine.server.stats().submitted == 0
        assert engine.server.stats().too_large == 1
        async with asyncio.timeout(10):
            assert [o["i"] async for o in honest.open({"n": 2})] == [1, 2]


_MANY = [1] * (wire.MAX_ENTRIES + 1)  # (an Abort's list: any ints will do)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(msgspec.msgpack.encode([5, -1, _MANY]), id="negative-seq"),
        pytest.param(msgspec.msgpack.encode([5, 2**63 - 1, _MANY]), id="int64-seq"),
        pytest.param(b"\xdc\x00\x03" + msgspec.msgpack.encode([5, 1, _MANY])[1:], id="array16"),
        pytest.param(b"\x93\xd0\x05" + msgspec.msgpack.encode([5, 1, _MANY])[2:], id="int8-tag"),
        pytest.param(msgspec.msgpack.encode([5, 1, _MANY, "extra"]), id="extra-field"),
    ],
)
async def test_a_message_of_too_many_entries_is_refused_unread_in_any_encoding(
    address: str, frame: bytes
) -> None:
    # (the decoder takes every one of these as an Abort: a count read only from the
    # canonical encoding let millions of entries through to be built in full)
    async with echo_engine(address) as engine, raw_peer(zmq.DEALER, engine.server.address) as peer:
        await say_hello(peer)
        assert isinstance(wire.decode(frame), wire.Abort)
        await peer.send(frame)
        reply = await answer(peer)
        assert isinstance(reply, wire.Refuse)
        assert str(wire.MAX_ENTRIES + 1) in reply.reason
        assert engine.server.stats().too_large == 1
        assert engine.server.stats().late_aborts == 0  # (not one entry was read)


async def test_a_batch_of_more_submissions_than_one_message_may_hold_fails_alone_with_413(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        with pytest.raises(PayloadTooLarge, match="submissions") as caught:
            client.open_batch([{"n": 1}] * (wire.MAX_ENTRIES + 1))
        assert tether.http.error_response(caught.value).status == 413
        assert client.registry.in_flight == 0
        async with asyncio.timeout(10):
            assert len(await client.open_batch([{"n": 1}] * wire.MAX_ENTRIES).result()) == 4096
        assert engine.server.in_flight == 0


async def test_submissions_past_what_the_engine_loop_has_waiting_are_refused_with_503(
    address: str,
) -> None:
    async with (
        EngineServer(address, max_events=3, consumer_timeout=60.0) as server,
        front(server.address) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(5)]  # (nobody takes them yet)
        async with asyncio.timeout(10):
            for stream in streams[3:]:
                with pytest.raises(tether.ProducerError) as caught:
                    await stream.result()
                assert tether.http.error_response(caught.value).status == 503
        assert len(server.receive_nowait()) == 3  # the first three, waiting in order
        assert server.stats().refused_submissions == 2
        assert server.in_flight == 3


@pytest.mark.parametrize(
    "request_", [{"prompt": "\ud800"}, {"prompt": object()}], ids=["lone-surrogate", "object"]
)
async def test_a_request_the_codec_cannot_encode_fails_alone_with_422(
    address: str, request_: object
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        with pytest.raises(UnencodableRequest) as caught:
            client.open(request_)
        assert tether.http.error_response(caught.value).status == 422
        assert client.registry.in_flight == 0
        async with asyncio.timeout(10):
            assert [o["i"] async for o in client.open({"n": 1})] == [1]


async def test_a_failure_whose_text_is_not_unicode_still_reaches_its_request(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        engine.server.send(failures=[(engine.submitted[0], Refusal("bad \ud800 input"))])
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert str(caught.value.__cause__) == "bad ? input"
        assert client.stats().links_lost == 0


class Weird(RuntimeError):
    status_code = 2**70


async def test_a_failure_with_a_status_no_wire_can_carry_reaches_its_request_as_500(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        engine.server.send(failures=[(engine.submitted[0], Weird("odd"))])
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert tether.http.error_response(caught.value).status == 500


async def test_one_front_can_hold_no_more_live_requests_than_its_share_and_others_go_on(
    address: str,
) -> None:
    async with (
        echo_engine(address, max_front_requests=3) as engine,
        front(engine.server.address) as greedy,
        front(engine.server.address) as other,
    ):
        streams = [greedy.open({"n": 0}) for _ in range(5)]  # (live until the test ends them)
        async with asyncio.timeout(10):
            for stream in streams[3:]:
                with pytest.raises(tether.ProducerError) as caught:
                    await stream.result()
                assert tether.http.error_response(caught.value).status == 503
                assert "live" in str(caught.value.__cause__)
            assert await other.open({"n": 1}).result() == {"i": 1, "front": other.incarnation}
        await eventually(lambda: len(engine.submitted) == 4)  # greedy's first 3, the other's 1
        engine.server.send((key, "done", True) for key in engine.submitted[:3])
        async with asyncio.timeout(10):
            assert [await stream.result() for stream in streams[:3]] == ["done"] * 3
            assert await greedy.open({"n": 1}).result() == {"i": 1, "front": greedy.incarnation}
        assert engine.server.stats().refused_submissions == 2
        assert greedy.registry.in_flight == 0
        assert engine.server.in_flight == 0


async def test_a_step_of_more_outputs_than_one_message_may_hold_arrives_whole_in_parts(
    address: str,
) -> None:
    count = wire.MAX_ENTRIES * 2 + 10
    async with (
        echo_engine(address) as engine,
        front(engine.server.address, registry_options={"max_pending": 2 * count}) as client,
    ):
        batch = client.open_batch([{"n": 0}] * 2)
        await eventually(lambda: len(engine.submitted) == 2)
        first, second = engine.submitted
        outputs = [(first, i, False) for i in range(count)] + [(first, count, True)]
        engine.server.send([*outputs, (second, "last", True)])
        async with asyncio.timeout(10):
            got = [(index, output) async for index, output in batch]
        assert [output for index, output in got if index == 0] == list(range(count + 1))
        assert [output for index, output in got if index == 1] == ["last"]
        assert client.stats().steps == 3
        assert client.stats().links_lost == 0
