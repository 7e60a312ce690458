"""Exchange: the status waits for the first output; chunks, pings, errors and the end."""

from __future__ import annotations

import asyncio
import json

import pytest

import tether
import tether.http
import tether.resume
from tests._support.direct_writes import (
    DirectTransport,
    DirectWriter,
    parked,
    sse_values,
    started_and_parked,
)

from .conftest import AbortLog


async def test_non_streaming_answers_with_the_result_as_one_json_body(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=False)
    registry.deliver(stream.rid, {"text": "hi"}, finished=True)
    async with asyncio.timeout(10):
        head = await exchange.start()
    assert head == tether.http.Head(200, {"content-type": "application/json"}, b'{"text":"hi"}')
    assert exchange.done
    assert exchange.done
    assert await exchange.next_chunk() == b""


async def test_non_streaming_error_becomes_its_status_with_a_json_body(
    registry: tether.Registry,
) -> None:
    stream = registry.open(timeout=0.05)
    async with asyncio.timeout(10):
        exchange = tether.http.Exchange(stream, streaming=False)
        head = await exchange.start()
    assert head.status == 504
    assert exchange.done
    assert json.loads(head.body)["error"]["type"] == "RequestTimeout"


async def test_non_streaming_keep_going_batch_puts_error_bodies_in_the_list(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2, keep_going=True)
    registry.deliver(batch.rids[0], "ok", finished=True)
    registry.fail(batch.rids[1], RuntimeError("bad"))
    async with asyncio.timeout(10):
        head = await tether.http.Exchange(batch, streaming=False).start()
    assert head.status == 200
    body = json.loads(head.body)
    assert body[0] == "ok"
    assert body[1]["error"]["type"] == "ProducerError"


async def test_streaming_head_carries_the_first_outputs_and_chunks_coalesce_the_rest(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, 1)
    async with asyncio.timeout(10):
        head = await exchange.start()
        assert head.status == 200
        assert head.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert head.headers["cache-control"] == "no-cache"
        assert not exchange.done
        assert sse_values(head.body) == [1]
        registry.deliver(stream.rid, 2)
        registry.deliver(stream.rid, 3, finished=True)
        # one write: the ready outputs and, the request being over, the terminal frame
        assert sse_values(await exchange.next_chunk() or b"") == [2, 3, "[DONE]"]
        assert exchange.done
        assert exchange.done
        assert await exchange.next_chunk() == b""
    assert exchange.done


async def test_streaming_error_before_the_first_output_gets_a_real_status(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.fail(stream.rid, RuntimeError("bad"))
    async with asyncio.timeout(10):
        head = await exchange.start()
    assert head.status == 500
    assert head.headers["content-type"] == "application/json"
    assert exchange.done
    assert json.loads(head.body)["error"]["type"] == "ProducerError"


async def test_streaming_error_after_the_first_output_is_an_error_event_then_the_end(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, encoder=tether.NDJSON)
    registry.deliver(stream.rid, "first")
    async with asyncio.timeout(10):
        head = await exchange.start()
        assert head.headers["content-type"] == "application/x-ndjson"
        assert head.body == b'"first"\n'
        registry.fail(stream.rid, RuntimeError("bad"))
        chunk = await exchange.next_chunk()
        assert chunk
        assert json.loads(chunk)["error"]["type"] == "ProducerError"
        assert exchange.done
        assert await exchange.next_chunk() == b""


async def test_streaming_server_abort_after_start_ends_with_an_error_event_and_done(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "first")
    async with asyncio.timeout(10):
        await exchange.start()
        registry.abort(stream.rid)
        values = sse_values(await exchange.next_chunk() or b"")
    assert values[0]["error"]["code"] == 503  # type: ignore[index]
    assert values[1] == "[DONE]"


async def test_client_disconnect_mid_stream_ends_the_response_quietly(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    with tether.RequestScope() as scope:
        stream = registry.open()
        exchange = tether.http.Exchange(stream, streaming=True)
        registry.deliver(stream.rid, "first")
        async with asyncio.timeout(10):
            await exchange.start()
            waiting = asyncio.ensure_future(exchange.next_chunk())
            scope.disconnect()
            assert await waiting == b""
    assert aborts.calls == {stream.rid: 1}


async def test_idle_stream_pings_before_the_first_output_and_between_outputs(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=0.01)
    async with asyncio.timeout(10):
        head = await exchange.start()  # nothing within the interval: headers go with a ping
        assert (head.status, head.body, not exchange.done) == (200, b": ping\n\n", True)
        assert await exchange.next_chunk() == b": ping\n\n"
        registry.deliver(stream.rid, "x", finished=True)
        assert sse_values(await exchange.next_chunk() or b"") == ["x", "[DONE]"]
        assert exchange.done
        assert await exchange.next_chunk() == b""


async def test_streaming_a_request_finished_without_output_sends_only_the_end(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, "only", finished=True)
    await anext(stream)
    exchange = tether.http.Exchange(stream, streaming=True)
    async with asyncio.timeout(10):
        head = await exchange.start()
    assert (head.status, head.body, not exchange.done) == (200, b"data: [DONE]\n\n", False)


async def test_streaming_batch_writes_each_output_in_an_envelope_with_its_index(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2)
    registry.deliver(batch.rids[1], "b", finished=True)
    registry.deliver(batch.rids[0], {"text": "a", "index": 7}, finished=True)
    async with asyncio.timeout(10):
        exchange = tether.http.Exchange(batch, streaming=True)
        head = await exchange.start()
    assert sse_values(head.body) == [
        {"index": 1, "output": "b"},
        {"index": 0, "output": {"text": "a", "index": 7}},
        "[DONE]",
    ]
    assert exchange.done  # a batch already over is answered whole


async def test_exchange_aclose_aborts_the_unfinished_source(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    await exchange.aclose()
    assert exchange.done
    assert exchange.done
    assert await exchange.next_chunk() == b""
    assert aborts.calls == {stream.rid: 1}


async def test_exchange_rejects_a_foreign_source_and_a_non_positive_ping_interval(
    registry: tether.Registry,
) -> None:
    with pytest.raises(TypeError, match="Stream or Batch"):
        tether.http.Exchange(object(), streaming=True)  # type: ignore[arg-type]
    stream = registry.open()
    with pytest.raises(ValueError, match="ping_interval"):
        tether.http.Exchange(stream, streaming=True, ping_interval=0)
    await stream.aclose()


async def test_streaming_keep_going_batch_sends_a_failed_sub_request_as_an_error_body(
    registry: tether.Registry,
) -> None:
    batch = registry.open_batch(2, keep_going=True)
    registry.fail(batch.rids[0], RuntimeError("bad"))
    registry.deliver(batch.rids[1], "ok", finished=True)
    async with asyncio.timeout(10):
        head = await tether.http.Exchange(batch, streaming=True).start()
    failed, ok, end = sse_values(head.body)
    assert end == "[DONE]"
    assert failed["index"] == 0  # type: ignore[index]
    assert failed["error"]["type"] == "ProducerError"  # type: ignore[index]
    assert ok == {"index": 1, "output": "ok"}


async def test_an_output_the_encoder_cannot_serialise_after_the_start_ends_with_an_error_event(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True)
    registry.deliver(stream.rid, "fine")
    async with asyncio.timeout(10):
        await exchange.start()
        assert not exchange.done
        registry.deliver(stream.rid, object())  # not JSON
        chunk = await exchange.next_chunk() or b""
    error, end = sse_values(chunk)
    assert error["error"]["code"] == 500  # type: ignore[index]
    assert end == "[DONE]"
    assert exchange.done
    assert aborts.calls == {stream.rid: 1}
    assert registry.in_flight == 0


async def test_an_output_the_encoder_cannot_serialise_before_the_start_is_a_500(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, object())
    async with asyncio.timeout(10):
        exchange = tether.http.Exchange(stream, streaming=True)
        head = await exchange.start()
    assert (head.status, not exchange.done) == (500, False)
    assert json.loads(head.body)["error"]["code"] == 500
    assert aborts.calls == {stream.rid: 1}


async def test_a_json_result_uses_the_encoders_dumps_and_a_bad_one_is_a_500(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    registry.deliver(stream.rid, {"n": 1}, finished=True)
    encoder = tether.SSE(dumps=lambda value: b"custom")
    async with asyncio.timeout(10):
        head = await tether.http.Exchange(stream, streaming=False, encoder=encoder).start()
    assert (head.status, head.body) == (200, b"custom")
    broken = registry.open()
    registry.deliver(broken.rid, object(), finished=True)
    async with asyncio.timeout(10):
        head = await tether.http.Exchange(broken, streaming=False).start()
    assert head.status == 500


@pytest.mark.parametrize("before", ["nothing", "a-small-output", "a-chunk-of-small-outputs"])
async def test_a_large_backlog_goes_out_in_bounded_chunks_in_order_never_copied_whole(
    registry: tether.Registry, before: str
) -> None:
    """Also when the chunk before carried small outputs: their size says nothing of
    the backlog's."""
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=5)
    outputs = [{"n": n, "text": "x" * 100_000} for n in range(40)]  # 4 MB ready at once
    if before != "nothing":
        registry.deliver(stream.rid, {"n": -1, "text": ""})
    chunks = []
    if before == "a-chunk-of-small-outputs":
        async with asyncio.timeout(10):
            head = await exchange.start()  # (its bytes per output: a few dozen)
        chunks.append(head.body)
    for output in outputs[:-1]:
        registry.deliver(stream.rid, output)
    registry.deliver(stream.rid, outputs[-1], finished=True)
    async with asyncio.timeout(10):
        if not chunks:
            chunks.append((await exchange.start()).body)
        while not exchange.done:
            chunks.append(await exchange.next_chunk())
    values = sse_values(b"".join(chunks))
    assert values[-1] == "[DONE]"
    assert [value["n"] for value in values[:-1] if value["n"] >= 0] == list(range(40))  # type: ignore[index]
    largest = max(len(chunk) for chunk in chunks)
    assert largest <= 512 * 1024  # the 4 MB backlog was never joined into one buffer
    assert len(chunks) >= 8


async def test_an_unencodable_output_is_declined_by_the_sink_and_fails_the_request_in_the_loop(
    registry: tether.Registry, aborts: AbortLog
) -> None:
    async with asyncio.timeout(10):
        stream, exchange, writer, running = await started_and_parked(registry)
        assert registry.deliver(stream.rid, "second")
        assert registry.deliver(stream.rid, object())  # not JSON: declined, never raised
        assert registry.deliver(stream.rid, "third")  # the sink is gone: this one waits
        assert writer.sink.values() == ["second"]
        assert (aborts.calls, exchange.done) == ({}, False)
        # The write loop reads what waits, in order, and fails the request there.
        await running
    chunk, last = writer.framed[-1]
    error, end = sse_values(chunk)
    assert last
    assert error["error"]["code"] == 500  # type: ignore[index]
    assert end == "[DONE]"
    assert aborts.calls == {stream.rid: 1}
    assert registry.in_flight == 0


async def test_the_end_and_errors_reach_the_write_loop_past_the_sink(
    registry: tether.Registry,
) -> None:
    ended, failed = registry.open(), registry.open()
    exchanges = [tether.http.Exchange(stream, streaming=True) for stream in (ended, failed)]
    async with asyncio.timeout(10):
        runs = []
        for stream, exchange in zip((ended, failed), exchanges, strict=True):
            registry.deliver(stream.rid, "first")
            runs.append(await parked(exchange, (await exchange.start()).body))
        registry.deliver(ended.rid, "last", finished=True)
        registry.deliver(failed.rid, "second")
        registry.fail(failed.rid, RuntimeError("the engine broke"))
        # (the last output waits for the loop: it goes out with the end, in one write)
        assert [writer.sink.values() for writer, _ in runs] == [[], ["second"]]
        assert not any(exchange.done for exchange in exchanges)
        for _, running in runs:
            await running
    assert runs[0][0].framed[-1] == (b'data: "last"\n\ndata: [DONE]\n\n', True)
    error, end = sse_values(runs[1][0].framed[-1][0])
    assert error["error"]["type"] == "ProducerError"  # type: ignore[index]
    assert end == "[DONE]"
    assert all(exchange.done for exchange in exchanges)


class _Watched(DirectTransport):
    """A direct transport that tells ``seen`` once ``want`` outputs reached the client
    (through it or through the loop's own writes)."""

    def __init__(self, want: int) -> None:
        super().__init__()
        self.want, self.seen = want, asyncio.Event()
        self.framed: list[bytes] = []  # (the loop's writes, filled by the writer)

    def write(self, chunk: bytes) -> bool:
        written = super().write(chunk)
        self.check()
        return written

    def check(self) -> None:
        client = sse_values(b"".join([*self.framed, *self.written]))
        if sum(isinstance(value, dict) for value in client) >= self.want:
            self.seen.set()


class _Writer(DirectWriter):
    """``direct``: the framework writes without waiting (the producer's sink may);
    otherwise the loop is woken for each output."""

    def __init__(self, sink: _Watched, *, direct: bool) -> None:
        super().__init__(sink)
        self.watched, self.has_direct = sink, direct

    async def write(self, chunk: bytes, last: bool) -> None:
        await super().write(chunk, last)
        self.watched.framed.append(chunk)
        self.watched.check()

    def direct(self) -> DirectTransport | None:  # type: ignore[override]
        return self.sink if self.has_direct else None


@pytest.mark.parametrize("direct", [False, True], ids=["woken", "direct"])
async def test_a_backlog_larger_than_one_write_goes_out_whole_while_the_producer_is_silent(
    registry: tether.Registry, direct: bool
) -> None:
    """Outputs that did not fit in one write are written next, not held until the
    producer's next output or the next ping (here an hour away)."""
    stream = registry.open()
    exchange = tether.http.Exchange(stream, streaming=True, ping_interval=3600)
    for n in range(40):  # 4 MB at once, then nothing: the request stays open
        registry.deliver(stream.rid, {"n": n, "text": "x" * 100_000})
    async with asyncio.timeout(10):
        head = await exchange.start()  # (the first slice; the rest waits its turn)
    writer = _Writer(_Watched(40), direct=direct)
    running = asyncio.create_task(exchange.run(writer, head.body))
    try:
        async with asyncio.timeout(10):
            await writer.watched.seen.wait()
        values = sse_values(writer.body())
        assert [value["n"] for value in values] == list(range(40))  # type: ignore[index]
        assert len(writer.framed) + len(writer.sink.written) >= 8  # in bounded chunks
    finally:
        registry.deliver(stream.rid, {"n": 40, "text": ""}, finished=True)
        async with asyncio.timeout(10):
            await running
    assert sse_values(writer.body())[-1] == "[DONE]"


async def test_a_stream_one_exchange_answers_is_refused_to_another_and_the_first_keeps_it(
    registry: tether.Registry,
) -> None:
    stream = registry.open()
    first = tether.http.Exchange(stream, streaming=True)
    with pytest.raises(RuntimeError, match="a response takes a stream once"):
        tether.http.Exchange(stream, streaming=False)
    resume = tether.resume.Resume()
    with pytest.raises(RuntimeError, match="a response takes a stream once"):
        await resume.open(stream)
    await resume.aclose()
    registry.deliver(stream.rid, 1)
    registry.deliver(stream.rid, 2, finished=True)
    async with asyncio.timeout(10):
        head = await first.start()
    assert head.status == 200
    assert sse_values(head.body) == [1, 2, "[DONE]"]  # nothing taken by the refused ones
    await first.aclose()
    assert registry.in_flight == 0
