"""Submit, outputs, finish, batches and aborts across the link, on ipc:// and loopback TCP."""

from __future__ import annotations

import asyncio

import pytest

import tether
import tether.http
from tether_zmq import (
    Cancellation,
    EngineLost,
    EngineServer,
    EngineUnavailable,
    LinkDown,
    PayloadTooLarge,
    RemoteFailure,
    Submission,
)

from .conftest import eventually
from .linked import echo_engine, front

pytestmark = pytest.mark.timeout(60)


async def test_handshake_opens_one_session_per_front(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        assert client.ready
        assert client.stats().sessions == 1
        assert engine.server.stats().fronts == 1


async def test_submitted_request_gets_every_output_in_order_then_finishes(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        async with asyncio.timeout(10):
            outputs = [output["i"] async for output in client.open({"n": 5})]
        assert outputs == [1, 2, 3, 4, 5]
        assert client.registry.in_flight == 0
        assert client.stats().in_flight == 0
        assert engine.server.in_flight == 0


async def test_a_step_for_many_requests_of_one_front_is_one_message(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        streams = [client.open({"n": 0}) for _ in range(50)]
        await eventually(lambda: len(engine.submitted) == 50)
        before = client.stats().steps
        engine.server.send((key, {"i": 1}, True) for key in engine.submitted)
        async with asyncio.timeout(10):
            results = [await stream.result() for stream in streams]
        assert results == [{"i": 1}] * 50
        assert client.stats().steps == before + 1


async def test_batch_is_submitted_whole_and_each_sub_request_gets_its_own_outputs(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        batch = client.open_batch([{"n": 1}, {"n": 2}, {"n": 3}])
        async with asyncio.timeout(10):
            results = await batch.result()
        assert [result["i"] for result in results] == [1, 2, 3]
        assert sorted(key.rid for key in engine.submitted) == sorted(batch.rids)
        assert engine.server.in_flight == 0


async def test_two_fronts_with_the_same_rid_never_collide(address: str) -> None:
    async with (
        echo_engine(address) as engine,
        front(engine.server.address) as one,
        front(engine.server.address) as two,
    ):
        first = one.open({"n": 3}, rid="same")
        second = two.open({"n": 3}, rid="same")
        async with asyncio.timeout(10):
            seen_one = [output["front"] async for output in first]
            seen_two = [output["front"] async for output in second]
        assert seen_one == [one.incarnation] * 3
        assert seen_two == [two.incarnation] * 3
        assert len(set(engine.submitted)) == 2


async def test_closing_a_stream_cancels_it_in_the_engine_exactly_once(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        await stream.aclose()
        await stream.aclose()
        await eventually(lambda: len(engine.cancelled) == 1)
        cancellation = engine.cancelled[0]
        assert cancellation.key == engine.key(stream.rid)
        assert cancellation.reason == "aborted"
        # An output the engine sends after the abort is late on both ends, never an error.
        engine.server.send([(cancellation.key, {"i": 1}, True)])
        assert engine.server.stats().late_outputs == 1
        assert engine.server.in_flight == 0
        assert client.registry.in_flight == 0


async def test_aborts_of_one_loop_tick_reach_the_engine_together(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        streams = [client.open({"n": 0}) for _ in range(20)]
        await eventually(lambda: len(engine.submitted) == 20)
        engine.changed.clear()
        for stream in streams:
            stream.cancel()
        async with asyncio.timeout(10):
            await engine.changed.wait()
        assert len(engine.cancelled) == 20  # one receive() got them all: one message
        assert {c.key.rid for c in engine.cancelled} == {s.rid for s in streams}


async def test_a_deadline_cancels_the_request_in_the_engine(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0}, timeout=0.05)
        async with asyncio.timeout(10):
            with pytest.raises(tether.RequestTimeout):
                await stream.result()
        await eventually(lambda: len(engine.cancelled) == 1)
        assert engine.cancelled[0].key.rid == stream.rid
        assert engine.server.in_flight == 0


class PromptTooLong(ValueError):
    status_code = 422


async def test_an_engine_failure_reaches_the_consumer_with_its_status(address: str) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        stream = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        engine.server.send(failures=[(engine.submitted[0], PromptTooLong("prompt too long"))])
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        cause = caught.value.__cause__
        assert isinstance(cause, RemoteFailure)
        assert cause.status_code == 422
        refusal = tether.http.error_response(caught.value)
        assert refusal.status == 422
        assert "prompt too long" in refusal.body["error"]["message"]
        assert engine.server.in_flight == 0
        assert client.stats().in_flight == 0


async def test_no_engine_means_503_with_retry_after_at_once_and_nothing_registered(
    address: str, ipc_dir: str
) -> None:
    nowhere = f"ipc://{ipc_dir}/nobody" if address.startswith("ipc") else "tcp://127.0.0.1:9"
    async with front(nowhere, ready=False, retry_after=2.0) as client:
        with pytest.raises(EngineUnavailable) as caught:
            client.open({"n": 1})
        assert client.registry.in_flight == 0
        refusal = tether.http.error_response(caught.value)
        assert refusal.status == 503
        assert refusal.headers["retry-after"] == "2"


async def test_a_step_past_max_message_is_split_and_an_output_past_it_fails_alone(
    address: str,
) -> None:
    limit = 4096
    async with (
        echo_engine(address, max_message=limit) as engine,
        front(engine.server.address, max_message=limit) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(40)]
        huge = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 41)
        keys = {key.rid: key for key in engine.submitted}
        engine.server.send(
            [(keys[stream.rid], "x" * 200, True) for stream in streams]
            + [(keys[huge.rid], "x" * limit, True)]
        )
        async with asyncio.timeout(10):
            assert [await stream.result() for stream in streams] == ["x" * 200] * 40
            with pytest.raises(tether.ProducerError):
                await huge.result()
        assert client.stats().steps > 1
        assert engine.server.stats().too_large == 1


async def test_a_request_past_max_message_is_refused_before_it_is_registered(
    address: str,
) -> None:
    async with (
        echo_engine(address, max_message=4096) as engine,
        front(engine.server.address, max_message=4096) as client,
    ):
        with pytest.raises(PayloadTooLarge):
            client.open({"n": 1, "pad": "x" * 5000})
        assert client.registry.in_flight == 0


async def test_closing_the_front_fails_its_requests_with_503(address: str) -> None:
    async with echo_engine(address) as engine:
        async with front(engine.server.address) as client:
            stream = client.open({"n": 0})
            await eventually(lambda: len(engine.submitted) == 1)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert isinstance(caught.value.__cause__, EngineLost)
        assert tether.http.error_response(caught.value).status == 503


async def test_failures_past_max_message_are_split_and_each_reaches_its_request(
    address: str,
) -> None:
    limit = 4096
    async with (
        echo_engine(address, max_message=limit) as engine,
        front(engine.server.address, max_message=limit) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(40)]
        await eventually(lambda: len(engine.submitted) == 40)
        reason = PromptTooLong("x" * 200)
        engine.server.send(failures=[(key, reason) for key in engine.submitted])
        async with asyncio.timeout(10):
            for stream in streams:
                with pytest.raises(tether.ProducerError):
                    await stream.result()
        assert client.stats().steps > 1
        assert client.stats().malformed == 0
        assert engine.server.in_flight == 0


async def test_calls_from_another_thread_are_refused_with_an_error_that_says_what_to_do(
    address: str,
) -> None:
    async with echo_engine(address) as engine, front(engine.server.address) as client:
        waiting = client.open({"n": 0})
        await eventually(lambda: len(engine.submitted) == 1)
        key = engine.submitted[0]
        calls = {
            "open": lambda: client.open({"n": 1}),
            "send": lambda: engine.server.send([(key, "from a thread", True)]),
            "receive_nowait": engine.server.receive_nowait,
        }
        refusals = {}
        for name, call in calls.items():
            try:
                await asyncio.to_thread(call)
            except RuntimeError as exc:
                refusals[name] = str(exc)
        assert set(refusals) == set(calls)
        assert all("call_soon_threadsafe" in text for text in refusals.values())
        assert client.registry.in_flight == 1  # (the refused open left nothing behind)
        assert engine.server.in_flight == 1
        engine.server.send([(key, "from its loop", True)])
        async with asyncio.timeout(10):
            assert await waiting.result() == "from its loop"


async def test_a_closed_engine_server_ends_its_sessions_and_refuses_to_be_waited_on(
    address: str,
) -> None:
    server = EngineServer(address, peer_timeout=2.0)
    with pytest.raises(RuntimeError, match="before start"):
        await server.receive()  # (not a wait for ever)
    await server.start()
    async with front(server.address) as client:
        stream = client.open({"n": 0})
        async with asyncio.timeout(10):
            (submission,) = await server.receive()
        assert isinstance(submission, Submission)
        assert server.stats().fronts == 1
        async with asyncio.timeout(10):
            blocked = asyncio.create_task(server.receive())
            await server.aclose()
            (cancellation,) = await blocked  # (woken with what waits, not cancelled)
        assert cancellation == Cancellation(submission.key, "front_lost")
        server.send([(submission.key, "too late", True)])  # (counted, not raised)
        assert server.stats().late_outputs == 1
        assert server.in_flight == 0
        with pytest.raises(LinkDown, match="closed"):
            await server.receive()
        with pytest.raises(RuntimeError, match="already"):
            await server.start()
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert isinstance(caught.value.__cause__, EngineLost)
