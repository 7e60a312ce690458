"""The write loop, woken or parked behind a direct write: whatever it meets after a
write (a second reader parked meanwhile, buffered items, the end), it ends the
response with frames, never with an exception out of ``run()``."""

from __future__ import annotations

import asyncio

import pytest

import tether
import tether.http
from tests._support.direct_writes import DirectTransport, sse_values, started_and_parked

BOUND = 10


class _HeldWriter:
    """A framework write (no direct write: the loop is woken per output) that holds
    each write after the first until ``release`` is set."""

    lost_when_cut = False

    def __init__(self) -> None:
        self.framed: list[tuple[bytes, bool]] = []
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.hold_next = False
        self.changed = asyncio.Event()

    async def start(self) -> None:
        return None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.framed.append((chunk, last))
        self.changed.set()
        if self.hold_next:
            self.hold_next = False
            self.holding.set()
            await self.release.wait()

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("the response had started")

    def drop(self) -> None:
        raise AssertionError("nobody stalled")

    def direct(self) -> None:
        return None

    def body(self) -> bytes:
        return b"".join(chunk for chunk, _ in self.framed)


async def test_a_reader_parked_during_a_write_ends_the_response_with_frames_not_an_exception(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 1)
    async with asyncio.timeout(BOUND):
        head = await exchange.start()
    writer = _HeldWriter()
    writer.hold_next = True  # the head's body: held while a second reader parks
    running = asyncio.create_task(exchange.run(writer, head.body))
    async with asyncio.timeout(BOUND):
        await writer.holding.wait()
    second = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)  # (a yield: the second reader parks)
    writer.release.set()
    async with asyncio.timeout(BOUND):
        outcome = await asyncio.gather(running, return_exceptions=True)
        await asyncio.gather(second, return_exceptions=True)
    # The write loop found another reader: the response ends with frames (an error
    # event and the end, as a refused poll gives), not with ConcurrentRead out of run().
    assert outcome == [None], outcome
    values = sse_values(writer.body())
    assert values[0] == 1
    assert values[-1] == "[DONE]"
    assert writer.framed[-1][1] is True
    assert registry.in_flight == 0


async def test_wait_ready_returns_at_once_when_outputs_wait_in_the_read_buffer(
    registry: tether.Registry,
) -> None:
    """``wait_ready``: "at once if [ready()] has [something] already", including the
    outputs an ``async for`` took with the first but has not handed out yet."""
    stream = registry.open()
    for n in range(3):
        registry.deliver(stream.rid, n)
    async with asyncio.timeout(BOUND):
        assert await stream.__anext__() == 0  # (1 and 2 wait in the read buffer)
    try:
        async with asyncio.timeout(2):
            await stream.wait_ready(timeout=None)
    except TimeoutError:
        pytest.fail("wait_ready parked while ready() had [1, 2]")
    assert stream.ready() == [1, 2]
    registry.deliver(stream.rid, 3, finished=True)


async def test_outputs_left_in_the_read_buffer_by_a_read_during_a_write_go_out_at_once(
    registry: tether.Registry,
) -> None:
    """A read of the same stream while the loop writes takes one output (a misuse,
    but not refused while nobody is parked); the rest it buffered goes out next,
    not at the next output or ping (here an hour away)."""
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 0)
    async with asyncio.timeout(BOUND):
        head = await exchange.start()
    writer = _HeldWriter()
    writer.hold_next = True
    running = asyncio.create_task(exchange.run(writer, head.body))
    try:
        async with asyncio.timeout(BOUND):
            await writer.holding.wait()
        for n in (1, 2, 3):
            registry.deliver(stream.rid, n)
        async with asyncio.timeout(BOUND):
            assert await stream.__anext__() == 1  # (2 and 3 wait in the read buffer)
        writer.release.set()
        try:
            async with asyncio.timeout(2):
                while 3 not in sse_values(writer.body()):
                    writer.changed.clear()
                    await writer.changed.wait()
        except TimeoutError:
            pytest.fail(f"2 and 3 held back: the client got {sse_values(writer.body())}")
    finally:
        registry.deliver(stream.rid, 4, finished=True)
        async with asyncio.timeout(BOUND):
            await running
    assert sse_values(writer.body()) == [0, 2, 3, 4, "[DONE]"]


async def test_a_second_reader_while_the_loop_is_parked_or_just_woken_is_refused(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 0)
    async with asyncio.timeout(BOUND):
        head = await exchange.start()
    writer = _HeldWriter()
    running = asyncio.create_task(exchange.run(writer, head.body))

    async def refused_everywhere() -> None:
        with pytest.raises(tether.ConcurrentRead):
            stream.ready()
        for read in (
            stream.__anext__,
            stream.wait_ready,
            stream.next_ready,
            stream.result,
        ):
            with pytest.raises(tether.ConcurrentRead):
                await read()

    async with asyncio.timeout(BOUND):
        while not writer.framed:
            writer.changed.clear()
            await writer.changed.wait()
        await asyncio.sleep(0)  # (a yield: the loop parks)
        await refused_everywhere()  # parked
        registry.deliver(stream.rid, 1)
        await refused_everywhere()  # woken, not yet resumed
        while 1 not in sse_values(writer.body()):
            writer.changed.clear()
            await writer.changed.wait()
        await asyncio.sleep(0)
        registry.deliver(stream.rid, 2, finished=True)
        await running
    assert sse_values(writer.body()) == [0, 1, 2, "[DONE]"]
    assert [last for _, last in writer.framed].count(True) == 1


class _Suspending(DirectTransport):
    """A direct write that suspends once (the sink begins it; the write loop finishes
    it) until ``gate`` is resolved."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.suspended = False

    def write(self, chunk: bytes) -> bool | asyncio.Future[None]:  # type: ignore[override]
        if self.suspended:
            return super().write(chunk)
        self.suspended = True
        self.written.append(chunk)
        return self.gate


async def test_a_reader_parked_while_the_loop_finishes_a_begun_direct_write_ends_it_with_frames(
    registry: tether.Registry,
) -> None:
    transport = _Suspending()
    stream, _, writer, running = await started_and_parked(registry, transport, ping_interval=3600)
    registry.deliver(stream.rid, "a")  # the sink begins the write: the loop awaits it
    for _ in range(3):
        await asyncio.sleep(0)  # (yields: the loop resumes and awaits the gate)
    second = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)  # (a yield: the second reader parks)
    assert not second.done()
    assert not running.done()
    transport.gate.set_result(None)
    async with asyncio.timeout(BOUND):
        outcome = await asyncio.gather(running, return_exceptions=True)
        await asyncio.gather(second, return_exceptions=True)
    assert outcome == [None], outcome
    values = sse_values(writer.body())
    assert values[:2] == ["first", "a"], values
    assert values[2]["error"]["type"] == "ConcurrentRead", values  # type: ignore[index]
    assert values[-1] == "[DONE]", values
    assert writer.framed[-1][1] is True
    assert registry.in_flight == 0
