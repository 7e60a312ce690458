"""What a stall or a death of one end's own machinery does: a loop that blocked for a
while judges nobody before reading what arrived meanwhile; an engine loop that stops
taking its events, or a task of the link that dies, takes the link down loudly, so
that no request waits on a loop nobody runs.

Stalls are injected as a blocking call in the test's loop (``threading.Event().wait``
with a bound: the fault itself, never a synchronisation); the peer runs in another
process, so its loop goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

import tether
import tether.http
from tether_zmq import (
    Cancellation,
    EngineLost,
    EngineServer,
    EngineUnavailable,
    LinkDown,
    Submission,
)

from .conftest import engine_process, eventually, fixed_address, spawned
from .linked import echo_engine, front
from .test_liveness import linked_front, read_until_failure, recording_engine

pytestmark = [pytest.mark.timeout(90), pytest.mark.parametrize("transport", ["ipc", "tcp"])]

STALL = 0.6
"""How long the test blocks its own loop: twice the timeout it must not trip (0.3 s),
which leaves that much room for a loaded machine's own delays."""


def stall_this_loop() -> None:
    threading.Event().wait(STALL)  # blocks the event loop, as a slow handler would


async def test_a_stall_of_the_front_s_own_loop_is_not_blamed_on_the_engine(
    transport: str, ipc_dir: str
) -> None:
    address = fixed_address(transport, ipc_dir)
    async with (
        engine_process(address, peer_timeout=5.0) as (_, bound),
        linked_front(bound, engine_timeout=0.3) as client,
    ):
        streams = [client.open({"n": 0}) for _ in range(5)]
        for _ in range(3):
            async with asyncio.timeout(10):
                for stream in streams:
                    await anext(aiter(stream))
            stall_this_loop()
        async with asyncio.timeout(10):
            for stream in streams:
                await anext(aiter(stream))  # every request is still served
        assert client.ready
        assert client.stats().links_lost == 0
        for stream in streams:
            await stream.aclose()


async def test_a_stall_of_the_engine_s_own_loop_is_not_blamed_on_its_fronts(
    transport: str, ipc_dir: str
) -> None:
    address = fixed_address(transport, ipc_dir)
    async with (
        recording_engine(address, peer_timeout=0.3) as engine,
        spawned("front_proc.py", address, "4") as other,
    ):
        identity = str((await other.first("ready"))["ready"]).encode()
        await eventually(lambda: len(engine.submitted(identity)) == 4)
        await other.first("outputs")
        for _ in range(3):
            stall_this_loop()
            seen = len(other.find("outputs"))
            # Streaming goes on to that front after the stall: it kept its session.
            await eventually(lambda seen=seen: len(other.find("outputs")) >= seen + 2)
        assert not engine.cancelled(identity)
        assert engine.server.stats().fronts_lost == 0
        assert not other.find("failed")


@contextlib.asynccontextmanager
async def idle_engine(address: str, **options: float) -> AsyncIterator[EngineServer]:
    """An engine whose loop takes no events until the test calls ``receive()``."""
    async with EngineServer(address, peer_timeout=2.0, **options) as server:
        yield server


async def test_an_engine_loop_that_stops_taking_events_ends_every_session_until_it_resumes(
    transport: str, ipc_dir: str
) -> None:
    address = fixed_address(transport, ipc_dir)
    async with idle_engine(address, consumer_timeout=0.2) as server, front(address) as client:
        waiting = client.open({"n": 0})
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await waiting.result()
        assert isinstance(caught.value.__cause__, EngineLost)
        assert tether.http.error_response(caught.value).status == 503
        await eventually(lambda: "stalled" in client_refusal(client))
        assert server.stats().stalled
        assert server.stats().stalls == 1
        # The loop comes back: it gets the submission and its cancellation, once each,
        # and the front gets a session again.
        async with asyncio.timeout(10):
            events = await server.receive()
        assert [type(event) for event in events] == [Submission, Cancellation]
        assert {event.key for event in events} == {events[0].key}
        async with asyncio.timeout(10):
            await client.wait_ready()
        assert not server.stats().stalled
        assert client.registry.in_flight == 0
        assert server.in_flight == 0


def client_refusal(client: object) -> str:
    """The reason a front gives for refusing a request now ("" when it takes them)."""
    assert hasattr(client, "open")
    try:
        stream = client.open({"n": 0})
    except EngineUnavailable as exc:
        return str(exc)
    stream.cancel()
    return ""


def task_named(name: str) -> asyncio.Task[object]:
    (task,) = [task for task in asyncio.all_tasks() if task.get_name() == name]
    return task


async def test_a_dead_task_of_the_engine_link_takes_it_down_loudly(
    transport: str, ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    address = fixed_address(transport, ipc_dir)
    async with idle_engine(address) as server, front(address) as client:
        stream = client.open({"n": 0})
        async with asyncio.timeout(10):
            (submission,) = await server.receive()
        assert isinstance(submission, Submission)
        task_named("zmq-engine-in").cancel()  # (whoever does it: not the owner)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await stream.result()
        assert isinstance(caught.value.__cause__, EngineLost)
        async with asyncio.timeout(10):
            (cancellation,) = await server.receive()
        assert cancellation == Cancellation(submission.key, "front_lost")
        with pytest.raises(LinkDown, match="zmq-engine-in"):
            await server.receive()
        assert "engine link down" in caplog.text
        assert client.registry.in_flight == 0


async def test_a_dead_task_of_the_front_link_fails_its_requests_and_says_why(
    transport: str, ipc_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    address = fixed_address(transport, ipc_dir)
    async with echo_engine(address) as engine, front(address) as client:
        first = asyncio.Event()
        reader = asyncio.create_task(read_until_failure(client.open({"n": 0}), first))
        await eventually(lambda: len(engine.submitted) == 1)
        task_named("zmq-front-monitor").cancel()
        async with asyncio.timeout(10):
            error = await reader
        assert isinstance(error.__cause__, EngineLost)
        assert "zmq-front-monitor" in client_refusal(client)
        assert "engine link broken" in caplog.text
        await eventually(lambda: len(engine.cancelled) == 1)  # (its socket closed: seen at once)
        assert client.registry.in_flight == 0
