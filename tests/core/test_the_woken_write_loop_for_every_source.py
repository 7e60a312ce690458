"""The woken write loop (it waits first, then polls once) against every source
and every way a response ends: a batch, a resumable stream's follower, pings at the
interval, the end / a failure / an abort / a cancellation / a close from another
task / an output nobody can write while parked. Exactly one terminal frame, nothing
lost, nothing twice, in order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest

import tether
import tether.http
import tether.resume
from tests._support.direct_writes import sse_values
from tests._support.observers import Recorder as Observed

BOUND = 10


class _Recorder:
    """A framework write with no direct write: the loop is woken per output."""

    lost_when_cut = False

    def __init__(self) -> None:
        self.framed: list[tuple[float, bytes, bool]] = []
        self.changed = asyncio.Event()

    async def start(self) -> None:
        return None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.framed.append((time.monotonic(), chunk, last))
        self.changed.set()

    async def answer(self, head: tether.http.Head) -> None:
        raise AssertionError("the response had started")

    def drop(self) -> None:
        raise AssertionError("nobody stalled")

    def direct(self) -> None:
        return None

    def body(self) -> bytes:
        return b"".join(chunk for _, chunk, _ in self.framed)

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    def pings(self) -> list[float]:
        return [at for at, chunk, _ in self.framed if chunk == b": ping\n\n"]


def _values(data: bytes) -> list[object]:
    """The ``data:`` values of every frame (with or without an ``id:`` line)."""
    lines = [
        line
        for frame in data.split(b"\n\n")
        for line in frame.split(b"\n")
        if line.startswith(b"data: ")
    ]
    return sse_values(b"".join(line + b"\n\n" for line in lines))


def _ends_once(writer: _Recorder) -> None:
    lasts = [last for _, _, last in writer.framed]
    assert lasts.count(True) == 1, writer.framed
    assert lasts[-1] is True, writer.framed
    assert writer.body().count(b"[DONE]") == 1


async def _started(exchange: tether.http.Exchange, writer: _Recorder) -> asyncio.Task[None]:
    async with asyncio.timeout(BOUND):
        head = await exchange.start()
    assert head.status == 200, head
    return asyncio.create_task(exchange.run(writer, head.body))


async def test_a_silent_stream_pings_at_the_interval_and_an_output_between_pings_goes_at_once(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=0.05)
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    running = await _started(exchange, writer)
    await writer.until(lambda: len(writer.pings()) >= 6)
    pings = writer.pings()
    gaps = [b - a for a, b in pairwise(pings)]
    assert all(0.04 <= gap < 1.0 for gap in gaps), gaps  # (at about the interval)
    registry.deliver(stream.rid, 1)
    delivered = time.monotonic()
    await writer.until(lambda: 1 in sse_values(writer.body()))
    assert time.monotonic() - delivered < 0.04  # at once: before the next ping was due
    await writer.until(lambda: len(writer.pings()) >= 9)  # pings go on after it
    registry.deliver(stream.rid, 2, finished=True)
    async with asyncio.timeout(BOUND):
        await running
    assert sse_values(writer.body()) == [0, 1, 2, "[DONE]"]
    _ends_once(writer)


def test_pings_keep_their_interval_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> list[float]:
        registry = tether.Registry()
        stream = registry.open()
        exchange = tether.http.Exchange(stream, streaming=True, ping_interval=0.05)
        registry.deliver(stream.rid, 0)
        writer = _Recorder()
        running = await _started(exchange, writer)
        await writer.until(lambda: len(writer.pings()) >= 8)
        registry.deliver(stream.rid, 1, finished=True)
        async with asyncio.timeout(BOUND):
            await running
        _ends_once(writer)
        return writer.pings()

    loop = uvloop.new_event_loop()
    try:
        pings = loop.run_until_complete(main())
    finally:
        loop.close()
    gaps = [b - a for a, b in pairwise(pings)]
    assert all(0.04 <= gap < 1.0 for gap in gaps), gaps


@pytest.mark.parametrize("how", ["fail", "abort", "finish-empty", "cancel-scope"])
async def test_an_end_while_the_loop_is_parked_writes_one_terminal_frame(
    registry: tether.Registry, how: str
) -> None:
    scope = tether.RequestScope().__enter__()  # (left open: the request goes on)
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600, scope=scope)
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    running = await _started(exchange, writer)
    await writer.until(lambda: bool(writer.framed))
    await asyncio.sleep(0)  # (a yield: the loop parks)
    registry.deliver(stream.rid, 1)
    await writer.until(lambda: 1 in sse_values(writer.body()))
    if how == "fail":
        registry.fail(stream.rid, RuntimeError("broke"))
    elif how == "abort":
        stream.cancel(tether.AbortReason.SERVER)
    elif how == "finish-empty":
        registry.deliver(stream.rid, 2, finished=True)
    else:
        scope.disconnect()
    async with asyncio.timeout(BOUND):
        await running
    values = sse_values(writer.body())
    if how == "cancel-scope":  # nobody reads: it ends quietly
        assert values[:2] == [0, 1]
        assert writer.framed[-1][2] is True
        return
    assert values[:2] == [0, 1]
    _ends_once(writer)
    if how in ("fail", "abort"):
        assert values[2]["error"]  # type: ignore[index]
        assert len(values) == 4


async def test_cancelling_the_handler_while_parked_aborts_the_request_as_cancelled(
    registry: tether.Registry,
) -> None:
    scope = tether.RequestScope().__enter__()  # (left open: the request goes on)
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600, scope=scope)
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    running = await _started(exchange, writer)
    await writer.until(lambda: bool(writer.framed))
    await asyncio.sleep(0)
    running.cancel()
    async with asyncio.timeout(BOUND):
        with pytest.raises(asyncio.CancelledError):
            await running
    assert registry.in_flight == 0
    values = sse_values(writer.body())
    assert values[0] == 0
    assert values[1]["error"]["code"] == 503  # type: ignore[index]  (the server ended it)
    _ends_once(writer)  # the farewell: the end, once
    scope.__exit__(None, None, None)


@pytest.mark.parametrize("keep_going", [False, True])
async def test_a_batch_through_the_woken_loop_hands_over_everything_once_in_order(
    registry: tether.Registry, keep_going: bool
) -> None:
    batch = registry.open_batch(3, keep_going=keep_going)
    exchange = tether.http.Exchange(batch, streaming=True, ping_interval=3600)
    registry.deliver(batch.rids[0], "a0")
    writer = _Recorder()
    running = await _started(exchange, writer)
    await writer.until(lambda: bool(writer.framed))
    expected: list[Any] = ["a0"]
    for n in range(1, 30):
        rid = batch.rids[n % 2]
        registry.deliver(rid, f"x{n}")
        expected.append(f"x{n}")
        if n % 5 == 0:
            want = len(expected)
            await writer.until(lambda want=want: len(sse_values(writer.body())) >= want)
    registry.deliver(batch.rids[2], "c", finished=True)
    expected.append("c")
    want = len(expected)  # (a failure in a batch that does not keep going drops the
    await writer.until(
        lambda want=want: len(sse_values(writer.body())) >= want
    )  # unread siblings')
    if keep_going:
        registry.fail(batch.rids[1], RuntimeError("one broke"))
        registry.deliver(batch.rids[0], "last", finished=True)
        expected += ["<error>", "last"]
    else:
        registry.fail(batch.rids[1], RuntimeError("one broke"))
        expected += ["<error>"]
    async with asyncio.timeout(BOUND):
        await running
    values = sse_values(writer.body())
    got = [v.get("output", "<error>") if isinstance(v, dict) else v for v in values]
    assert got == [*expected, "[DONE]"], values
    _ends_once(writer)
    assert registry.in_flight == 0


async def test_a_follower_hands_over_each_event_once_and_ends_when_replaced() -> None:
    registry = tether.Registry()
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    exchange = tether.http.Exchange(follower, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    running = await _started(exchange, writer)
    for n in range(1, 20):
        registry.deliver(stream.rid, n)
        await writer.until(lambda n=n: n in _values(writer.body()))
    newer = await resume.follow(tether.resume.resume_point(None, follower.token))  # type: ignore[arg-type]
    assert newer is not None
    async with asyncio.timeout(BOUND):
        await running  # replaced: it ends quietly, at once (not at the next ping)
    assert _values(writer.body()) == list(range(20))
    registry.deliver(stream.rid, "x", finished=True)
    async with asyncio.timeout(BOUND):
        got: list[object] = []
        while (items := await newer.next_ready()) is not None:
            got += [o for _, o in items]
    assert got == [*range(20), "x"]
    await newer.aclose()
    await resume.aclose()


async def test_a_follower_through_the_woken_loop_ends_with_one_terminal_frame() -> None:
    registry = tether.Registry()
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    exchange = tether.http.Exchange(follower, streaming=True, ping_interval=0.05)
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    running = await _started(exchange, writer)
    await writer.until(lambda: len(writer.pings()) >= 2)
    registry.deliver(stream.rid, 1, finished=True)
    async with asyncio.timeout(BOUND):
        await running
    assert _values(writer.body()) == [0, 1, "[DONE]"]
    _ends_once(writer)
    await resume.aclose()


async def _rearmed_waits() -> tuple[float, float, float]:
    """(a short wait after a long one; a long wait after a short one; a short wait
    after a long one whose timer was re-armed when the short one's fired early)."""
    loop = asyncio.get_running_loop()
    registry = tether.Registry()
    stream = registry.open()
    waiting = asyncio.create_task(stream.wait_ready(timeout=3600))
    await asyncio.sleep(0)  # (a yield: it parks)
    registry.deliver(stream.rid, 0)
    await waiting
    assert stream.ready() == [0]
    start = loop.time()
    await stream.wait_ready(timeout=0.05)  # the hour's timer must be replaced
    short_after_long = loop.time() - start

    waiting = asyncio.create_task(stream.wait_ready(timeout=0.05))
    await asyncio.sleep(0)
    registry.deliver(stream.rid, 1)
    await waiting
    assert stream.ready() == [1]
    start = loop.time()
    await stream.wait_ready(timeout=0.3)  # the 0.05 timer fires early: re-armed
    long_after_short = loop.time() - start

    waiting = asyncio.create_task(stream.wait_ready(timeout=0.05))
    await asyncio.sleep(0)
    registry.deliver(stream.rid, 2)
    await waiting
    assert stream.ready() == [2]
    ended = asyncio.Event()
    waiting = asyncio.create_task(stream.wait_ready(timeout=3.0))
    loop.call_later(0.15, lambda: (registry.deliver(stream.rid, 3), ended.set()))
    await waiting  # (its timer was re-armed for 3 s when the 0.05 one fired)
    assert ended.is_set()
    assert stream.ready() == [3]
    start = loop.time()
    await stream.wait_ready(timeout=0.05)  # the re-armed 3 s timer must be replaced
    short_after_rearmed = loop.time() - start
    registry.deliver(stream.rid, 4, finished=True)
    return short_after_long, long_after_short, short_after_rearmed


def _check_rearmed(times: tuple[float, float, float]) -> None:
    short_after_long, long_after_short, short_after_rearmed = times
    assert short_after_long < 1.0, times
    assert 0.28 <= long_after_short < 2.0, times
    assert short_after_rearmed < 1.0, times


async def test_each_timed_wait_ends_at_its_own_deadline_however_the_timer_was_armed() -> None:
    async with asyncio.timeout(BOUND):
        _check_rearmed(await _rearmed_waits())


def test_each_timed_wait_ends_at_its_own_deadline_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    try:
        _check_rearmed(loop.run_until_complete(asyncio.wait_for(_rearmed_waits(), BOUND)))
    finally:
        loop.close()


async def _parked(
    source: tether.Stream | tether.Batch, writer: _Recorder
) -> tuple[tether.http.Exchange, asyncio.Task[None]]:
    """A streaming exchange of ``source`` run until its first write, then parked."""
    exchange = tether.http.Exchange(source, streaming=True, ping_interval=3600)
    running = await _started(exchange, writer)
    await writer.until(lambda: bool(writer.framed))
    for _ in range(3):
        await asyncio.sleep(0)  # (yields, not a synchronisation: it parks or has)
    return exchange, running


@pytest.mark.parametrize("kind", ["stream", "batch"])
async def test_cancelling_the_handler_parked_in_the_woken_loop_aborts_with_reason_cancelled(
    kind: str,
) -> None:
    registry = tether.Registry()
    observed = Observed()
    registry.add_observer(observed)
    if kind == "batch":
        source: Any = registry.open_batch(2)
        rids = list(source.rids)
    else:
        source = registry.open()
        rids = [source.rid]
    registry.deliver(rids[0], 0)
    writer = _Recorder()
    _, running = await _parked(source, writer)
    registry.deliver(rids[0], 1)
    await writer.until(lambda: b"1" in writer.body().split(b"\n\n")[-2])
    running.cancel()
    async with asyncio.timeout(BOUND):
        with pytest.raises(asyncio.CancelledError):
            await running
    assert registry.in_flight == 0
    assert {rid: observed.ends[rid].reason for rid in rids} == dict.fromkeys(rids, "cancelled")
    _ends_once(writer)


@pytest.mark.parametrize("end", ["closed-from-another-task", "an-output-nobody-can-write"])
async def test_a_parked_stream_ended_from_elsewhere_ends_once_after_what_came_before(
    registry: tether.Registry, end: str
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, 0)
    writer = _Recorder()
    _, running = await _parked(stream, writer)
    registry.deliver(stream.rid, 1)
    await writer.until(lambda: 1 in sse_values(writer.body()))
    if end == "closed-from-another-task":
        await stream.aclose()
    else:
        registry.deliver(stream.rid, "\ud800")  # a lone surrogate: no JSON writer takes it
    async with asyncio.timeout(BOUND):
        await running
    values = sse_values(writer.body())
    assert values[:2] == [0, 1], values
    if end == "an-output-nobody-can-write":
        assert values[2]["error"]["code"] == 500, values  # type: ignore[index]
    _ends_once(writer)
    assert registry.in_flight == 0


class _CancelsAfter(_Recorder):
    """Cancels the task that made its first write (the handler's) in the loop turn
    after its ``nth`` write: whatever the write loop was about to do next."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.nth = nth
        self.handler: asyncio.Task[Any] | None = None

    async def write(self, chunk: bytes, last: bool) -> None:
        self.handler = self.handler or asyncio.current_task()
        await super().write(chunk, last)
        if len(self.framed) == self.nth and self.handler is not None:
            asyncio.get_running_loop().call_soon(self.handler.cancel)


@pytest.mark.parametrize("nth", range(1, 11))
async def test_a_handler_cancelled_after_any_write_of_a_woken_stream_ends_it_with_the_farewell(
    nth: int,
) -> None:
    registry = tether.Registry()
    observed = Observed()
    registry.add_observer(observed)
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    registry.deliver(stream.rid, 0)
    writer = _CancelsAfter(nth)
    running = await _started(exchange, writer)
    for n in range(1, 12):
        await writer.until(lambda n=n: n <= len(writer.framed) or running.done())  # type: ignore[misc]
        if running.done():
            break
        registry.deliver(stream.rid, n)
    async with asyncio.timeout(BOUND):
        outcome = await asyncio.gather(running, return_exceptions=True)
    assert isinstance(outcome[0], asyncio.CancelledError), outcome
    values = sse_values(writer.body())
    assert values[: len(values) - 2] == list(range(len(values) - 2)), values  # in order
    assert values[-2]["error"]["code"] == 503, values  # type: ignore[index]
    _ends_once(writer)
    assert registry.in_flight == 0
    assert observed.ends[stream.rid].reason == "cancelled"
