"""aiohttp streams on asyncio's loop and on uvloop, byte for byte on a raw socket: the
head goes out before any byte of the body (even with producer-side writes), every
chunk is framed exactly, the body ends once, the connection stays usable, for every
producer shape, for many clients at once, through pings, errors after the start, HEAD,
a stalled or departed client, a cancelled handler, custom encoders and batches."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

import tether
import tether_aiohttp
from tests._support.aborts import Aborted
from tests._support.servers import start_default_server
from tests._support.stalled import http_get, stalled_client

pytestmark = pytest.mark.both_loops

BOUND: Final = 10.0


@dataclass
class Server:
    registry: tether.Registry
    port: int
    opened: asyncio.Queue[str]
    aborted: list[str]
    aborted_changed: asyncio.Event
    loop_errors: list[dict[str, Any]]
    handlers: list[asyncio.Task[Any]] = field(default_factory=list)
    stop: Callable[[], Awaitable[None]] | None = None

    async def until_aborted(self, count: int = 1) -> None:
        async with asyncio.timeout(BOUND):
            while len(self.aborted) < count:
                self.aborted_changed.clear()
                await self.aborted_changed.wait()

    async def handlers_ended(self) -> None:
        for task in self.handlers:
            await task


Options = dict[str, Any]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    """Start a server (``web.run_app``'s mode) whose ``/s`` route streams one fresh
    request (or a batch of ``?batch=n``) with the ``respond`` options given."""
    runners: list[web.AppRunner] = []
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))

    async def start(
        access_log: logging.Logger | None = None, drain_timeout: float = 5.0, **options: Any
    ) -> Server:
        aborted = Aborted()
        registry = tether.Registry(aborted)
        opened: asyncio.Queue[str] = asyncio.Queue()
        server = Server(registry, 0, opened, aborted, aborted.seen, loop_errors)

        @web.middleware
        async def keep_task(request: web.Request, handler: Handler) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            server.handlers.append(task)
            return await handler(request)

        async def handle(request: web.Request) -> web.StreamResponse:
            source: tether.Stream | tether.Batch
            if "batch" in request.query:
                source = registry.open_batch(int(request.query["batch"]))
                for rid in source.rids:
                    opened.put_nowait(rid)
            else:
                source = registry.open()
                opened.put_nowait(source.rid)
            return await tether_aiohttp.respond(request, source, streaming=True, **options)

        app = web.Application(middlewares=[keep_task])
        tether_aiohttp.setup(app, registry, drain_timeout=drain_timeout)
        app.router.add_route("*", "/s", handle)
        if access_log is None:
            runner, port = await start_default_server(app)
        else:
            runner = web.AppRunner(
                app, handler_cancellation=False, access_log=access_log, access_log_format="%r %s"
            )
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
        runners.append(runner)
        server.port = port
        server.stop = runner.cleanup
        return server

    yield start
    for runner in runners:
        if runner.server is not None:
            await runner.cleanup()
    assert not loop_errors, loop_errors


async def strict_response(reader: asyncio.StreamReader) -> Response:
    """The next response on the connection, read exactly as HTTP/1.1 frames it: the
    status line and headers first, then each chunk (its size line in hex, its data,
    CRLF), then the last chunk; nothing is read past it. Returns the status line,
    the headers and the chunks' data."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head[:-4].split(b"\r\n")
    assert status.startswith(b"HTTP/1.1 "), head
    headers = {
        name.strip().lower().decode(): value.strip().decode()
        for name, _, value in (line.partition(b":") for line in lines)
    }
    if headers.get("transfer-encoding") != "chunked":
        length = int(headers.get("content-length", "0"))
        return status, headers, [await reader.readexactly(length)] if length else []
    return status, headers, await strict_chunks(reader)


async def strict_chunks(reader: asyncio.StreamReader) -> list[bytes]:
    """The data of each chunk up to the last one, each checked as HTTP/1.1 frames it."""
    chunks: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        assert size_line[:-2], chunks[-3:]
        assert all(c in b"0123456789abcdef" for c in size_line[:-2]), (size_line, chunks[-3:])
        size = int(size_line, 16)
        if size == 0:
            assert await reader.readexactly(2) == b"\r\n"
            return chunks
        data = await reader.readexactly(size + 2)
        assert data.endswith(b"\r\n"), data[-20:]
        chunks.append(data[:-2])


async def parsed(raw: bytes) -> bytes:
    """The body of the whole response ``raw``, read as strictly as from a socket."""
    feeder = asyncio.StreamReader()
    feeder.feed_data(raw)
    feeder.feed_eof()
    _, _, chunks = await strict_response(feeder)
    return b"".join(chunks)


def sse(output: Any) -> bytes:
    return (
        b"data: " + json.dumps(output, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


DONE: Final = b"data: [DONE]\n\n"


def outputs_for(client: int, count: int) -> list[Any]:
    """Small, non-ASCII and (every 40th) large outputs: large ones fill the transport's
    buffer, so that writes switch between the producer's step and the write loop."""
    return [
        {"c": client, "i": i, "t": ("x" * 300_000) if i % 40 == 39 else "é☃𝄞" * (i % 7)}
        for i in range(count)
    ]


Deliver = Callable[[tether.Registry, list[tuple[str, Any, bool]]], Awaitable[None]]


async def by_deliver(registry: tether.Registry, step: list[tuple[str, Any, bool]]) -> None:
    for rid, output, finished in step:
        registry.deliver(rid, output, finished=finished)


async def by_deliver_many(registry: tether.Registry, step: list[tuple[str, Any, bool]]) -> None:
    registry.deliver_many(step)


async def by_thread(registry: tether.Registry, step: list[tuple[str, Any, bool]]) -> None:
    handed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def engine() -> None:
        registry.deliver_many_threadsafe(step)
        loop.call_soon_threadsafe(handed.set)

    thread = threading.Thread(target=engine)
    thread.start()
    await handed.wait()  # (the step is handed over before this wakes: FIFO)
    thread.join()


SHAPES: Final = {"deliver": by_deliver, "deliver_many": by_deliver_many, "thread": by_thread}

Response = tuple[bytes, dict[str, str], list[bytes]]


async def open_stream(
    server: Server, target: str = "/s", method: str = "GET"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def start_reading(
    server: Server, target: str = "/s"
) -> tuple[asyncio.StreamWriter, str, asyncio.Task[Response]]:
    """Open a stream, take its request's rid, and read its response in a task."""
    reader, writer = await open_stream(server, target)
    rid = await server.opened.get()
    return writer, rid, asyncio.create_task(strict_response(reader))


async def deliver_numbered(registry: tether.Registry, rid: str, count: int) -> None:
    """Outputs ``{"n": 0}`` up to ``{"n": count - 1}``, the loop running between them."""
    for n in range(count):
        registry.deliver(rid, {"n": n})
        await asyncio.sleep(0)


def numbered(count: int) -> bytes:
    """The events of ``deliver_numbered``'s outputs."""
    return b"".join(sse({"n": n}) for n in range(count))


async def cancel_the_handler(
    server: Server, reading: asyncio.Task[Response]
) -> tuple[asyncio.Task[Any], list[bytes]]:
    """Cancel the one handler (the server's shutdown does), read the response to its
    end and wait for the handler; the handler and the response's chunks."""
    (task,) = server.handlers
    task.cancel()
    _, _, chunks = await reading
    await asyncio.wait([task])
    return task, chunks


def assert_outputs_then_one_error(body: bytes, outputs: bytes, code: int) -> None:
    """``body`` is ``outputs``, then one error event with ``code``, then the end."""
    assert body.startswith(outputs), body
    error, done, nothing = body[len(outputs) :].split(b"\n\n")
    assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == code
    assert (done, nothing) == (b"data: [DONE]", b"")


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_many_clients_each_get_their_exact_chunked_stream_for_every_producer_shape(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve()
    clients, count = 16, 120
    connections = []
    rids: list[str] = []
    async with asyncio.timeout(BOUND * 3):
        for _ in range(clients):
            connections.append(await open_stream(server))
            rids.append(await server.opened.get())
        expected = [outputs_for(c, count) for c in range(clients)]

        async def read_all(c: int) -> Response:
            return await strict_response(connections[c][0])

        readers = [asyncio.create_task(read_all(c)) for c in range(clients)]
        # Bursts of 1, 2, 3... outputs per request in one step; the loop runs between.
        i = 0
        burst = 1
        while i < count:
            n = min(burst, count - i)
            step = [
                (rids[c], expected[c][j], j == count - 1)
                for j in range(i, i + n)
                for c in range(clients)
            ]
            await deliver(server.registry, step)
            for _ in range(3):
                await asyncio.sleep(0)  # (lets the write loops run: not a synchronisation)
            i += n
            burst = burst % 5 + 1
        results = await asyncio.gather(*readers)
        for c, (status, headers, chunks) in enumerate(results):
            assert status.startswith(b"HTTP/1.1 200"), status
            assert headers["content-type"].startswith("text/event-stream")
            body = b"".join(chunks)
            assert body == b"".join(sse(o) for o in expected[c]) + DONE, c
        # The connection is still in step: a second request on it is answered whole.
        for c, (reader, writer) in enumerate(connections):
            writer.write(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
            rid = await server.opened.get()
            server.registry.deliver(rid, {"again": c}, finished=True)
            status, _, chunks = await strict_response(reader)
            assert b"".join(chunks) == sse({"again": c}) + DONE
            writer.close()
    assert server.registry.in_flight == 0
    assert not server.aborted


async def test_a_ping_sends_the_head_then_outputs_then_a_failure_is_one_error_event_and_the_end(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve(ping_interval=0.05)
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server)
        rid = await server.opened.get()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding: chunked" in head.lower()
        assert await reader.readexactly(13) == b"8\r\n: ping\n\n\r\n"
        reading = asyncio.create_task(strict_chunks(reader))
        for n in range(50):
            server.registry.deliver(rid, {"n": n, "s": "ü" * n})
            await asyncio.sleep(0)
        server.registry.fail(rid, RuntimeError("the engine broke"))
        chunks = await reading
        writer.close()
    body = b"".join(chunks).replace(b": ping\n\n", b"")
    outputs = b"".join(sse({"n": n, "s": "ü" * n}) for n in range(50))
    assert_outputs_then_one_error(body, outputs, 500)
    assert server.registry.in_flight == 0


async def test_head_answers_the_headers_alone_aborts_once_and_keeps_the_connection(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server, method="HEAD")
        rid = await server.opened.get()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"text/event-stream" in head
        await server.until_aborted()
        assert server.aborted == [rid]
        # No body followed: the next response on the connection starts right here.
        writer.write(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
        rid = await server.opened.get()
        server.registry.deliver(rid, {"a": 1})
        server.registry.deliver(rid, {"a": 2}, finished=True)
        status, _, chunks = await strict_response(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        assert b"".join(chunks) == sse({"a": 1}) + sse({"a": 2}) + DONE
        writer.close()
    assert server.registry.in_flight == 0
    assert len(server.aborted) == 1


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_client_that_stops_reading_is_dropped_by_the_send_timeout_for_every_shape(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve(send_timeout=0.3, ping_interval=0.05)
    big = "y" * (256 * 1024)
    async with stalled_client(server.port, http_get("/s")) as sock:
        async with asyncio.timeout(BOUND):
            rid = await server.opened.get()
            while not server.aborted:
                await deliver(server.registry, [(rid, big, False)])
                await asyncio.sleep(0.01)  # (a producer's pace: the abort is awaited below)
            await server.until_aborted()
            assert server.aborted == [rid]
            assert server.registry.in_flight == 0
            loop = asyncio.get_running_loop()
            try:
                while await loop.sock_recv(sock, 1 << 20):
                    pass
            except ConnectionResetError:
                pass
    stats = server.registry.stats()
    assert stats.aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_client_gone_mid_stream_aborts_the_work_once_while_the_producer_writes(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server)
        rid = await server.opened.get()
        await deliver(server.registry, [(rid, {"n": 0}, False)])
        await reader.readuntil(b'{"n":0}')
        writer.transport.abort()  # a reset, mid-stream
        n = 1
        while not server.aborted:
            await deliver(server.registry, [(rid, {"n": n}, False)])
            n += 1
            await asyncio.sleep(0)
        assert server.aborted == [rid]
        await server.handlers_ended()
    assert server.registry.in_flight == 0
    assert server.registry.stats().aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}
    await asyncio.sleep(0)
    assert server.aborted == [rid]


async def test_a_handler_cancelled_while_the_producer_writes_ends_with_the_farewell(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        await deliver_numbered(server.registry, rid, 5)
        task, chunks = await cancel_the_handler(server, reading)
        writer.close()
    assert task.cancelled()
    body = b"".join(chunks)
    events = body.split(b"\n\n")
    assert body.startswith(numbered(5)), body
    assert json.loads(events[-3].removeprefix(b"data: "))["error"]["code"] == 503
    assert events[-2:] == [b"data: [DONE]", b""]
    assert server.aborted == [rid]
    assert server.registry.in_flight == 0


class Shouting(tether.SSE):
    """Overrides frame() alone: every output's frame is named."""

    __slots__ = ()

    def frame(self, payload: bytes) -> bytes:
        return b"event: out\ndata: " + payload + b"\n\n"


class Tagged(tether.NDJSON):
    """Overrides encode() alone."""

    __slots__ = ()

    def encode(self, output: Any) -> bytes:
        return b"#" + super().encode(output)


ENCODERS: Final[dict[str, Callable[[], dict[str, Any]]]] = {
    "ndjson": lambda: {"encoder": tether.NDJSON()},
    "own-frame": lambda: {"encoder": Shouting()},
    "own-encode": lambda: {"encoder": Tagged()},
    "transform": lambda: {"transform": lambda output: {"wrapped": output}},
    "ndjson-transform": lambda: {"encoder": tether.NDJSON, "transform": lambda o: [o]},
}


@pytest.mark.parametrize("kind", list(ENCODERS))
async def test_custom_framing_reaches_the_wire_as_its_encoder_writes_it(
    serve: Callable[..., Awaitable[Server]], kind: str
) -> None:
    options = ENCODERS[kind]()
    server = await serve(**options)
    encoder = options.get("encoder", tether.SSE())
    if isinstance(encoder, type):
        encoder = encoder()
    if "transform" in options:
        encoder = encoder.shaped(options["transform"])
    outputs: list[Any] = [{"n": n, "t": "ß" * n} for n in range(30)]
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        for n, output in enumerate(outputs):
            server.registry.deliver(rid, output, finished=n == len(outputs) - 1)
            if n % 3:
                await asyncio.sleep(0)
        _, _, chunks = await reading
        writer.close()
    assert b"".join(chunks) == encoder.encode_many(outputs) + encoder.terminal()


async def test_a_streamed_batch_is_exactly_its_indexed_events(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server, "/s?batch=3")
        rids = [await server.opened.get() for _ in range(3)]
        reading = asyncio.create_task(strict_response(reader))
        expected = []
        for n in range(10):
            for index, rid in enumerate(rids):
                server.registry.deliver(rid, {"n": n}, finished=n == 9)
                expected.append({"index": index, "output": {"n": n}})
            await asyncio.sleep(0)
        _, _, chunks = await reading
        writer.close()
    assert b"".join(chunks) == b"".join(sse(e) for e in expected) + DONE


class Lines(logging.Handler):
    """Keeps what a logger writes, with an event set at each line."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.added = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.added.set()


async def test_the_access_log_has_one_line_per_stream_with_its_status(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    access = logging.getLogger("test.access")
    access.setLevel(logging.INFO)
    log = Lines()
    access.addHandler(log)
    try:
        server = await serve(access_log=access)
        async with asyncio.timeout(BOUND):
            reader, writer = await open_stream(server)
            rid = await server.opened.get()
            server.registry.deliver(rid, {"a": 1})
            await reader.readuntil(b'{"a":1}')
            server.registry.deliver(rid, {"a": 2}, finished=True)
            await reader.readuntil(b"\r\n0\r\n\r\n")
            writer.write(b"HEAD /s HTTP/1.1\r\nHost: t\r\n\r\n")
            await server.opened.get()
            await reader.readuntil(b"\r\n\r\n")
            while len(log.lines) < 2:
                log.added.clear()
                await log.added.wait()
            writer.close()
    finally:
        access.removeHandler(log)
    assert log.lines == ["GET /s HTTP/1.1 200", "HEAD /s HTTP/1.1 200"]


async def test_a_stream_the_producer_keeps_writing_gets_a_keep_alive_only_once_silent(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve(ping_interval=0.1)
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server)
        rid = await server.opened.get()
        server.registry.deliver(rid, {"n": 0})
        await reader.readuntil(b'{"n":0}')
        seen = b""
        for n in range(1, 31):  # an output every 10 ms, for 3 intervals
            await asyncio.sleep(0.01)
            server.registry.deliver(rid, {"n": n})
        seen += await reader.readuntil(b'{"n":30}')
        assert b": ping" not in seen
        seen += await reader.readuntil(b": ping")
        server.registry.deliver(rid, {"n": 31}, finished=True)
        await reader.readuntil(b"\r\n0\r\n\r\n")
        writer.close()


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_outputs_and_a_failure_in_one_step_arrive_in_order_before_one_error_event(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve()
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        await deliver(server.registry, [(rid, {"n": 0}, False)])
        for _ in range(5):
            await asyncio.sleep(0)
        await deliver(server.registry, [(rid, {"n": n}, False) for n in range(1, 4)])
        if shape == "thread":
            server.registry.fail_threadsafe(rid, RuntimeError("the engine broke"))
        else:
            server.registry.fail(rid, RuntimeError("the engine broke"))
        _, _, chunks = await reading
        writer.close()
    body = b"".join(chunks)
    outputs = numbered(4)
    assert_outputs_then_one_error(body, outputs, 500)
    assert server.registry.in_flight == 0


@pytest.mark.parametrize("bad", ["\ud800", float("nan")], ids=["lone-surrogate", "nan"])
async def test_an_output_that_cannot_be_written_after_direct_writes_is_one_error_event(
    serve: Callable[..., Awaitable[Server]], bad: Any
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        await deliver_numbered(server.registry, rid, 3)
        server.registry.deliver(rid, {"bad": bad})
        server.registry.deliver(rid, {"n": "never"}, finished=True)
        _, _, chunks = await reading
        writer.close()
    body = b"".join(chunks)
    outputs = numbered(3)
    if isinstance(bad, float):  # (NaN is written as null, as orjson writes it)
        assert body == outputs + sse({"bad": None}) + sse({"n": "never"}) + DONE, body
        return
    assert_outputs_then_one_error(body, outputs, 500)
    assert server.registry.in_flight == 0


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_megabyte_outputs_reach_a_slow_reader_whole_and_in_order(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve()
    outputs = [{"i": i, "t": chr(0x400 + i) * (2_500_000 if i % 3 == 0 else 10)} for i in range(12)]
    async with asyncio.timeout(BOUND * 3):
        reader, writer = await open_stream(server)
        rid = await server.opened.get()
        raw = bytearray()

        async def slow() -> None:
            while not raw.endswith(b"\r\n0\r\n\r\n"):
                data = await reader.read(16 * 1024)
                assert data
                raw.extend(data)
                await asyncio.sleep(0)

        reading = asyncio.create_task(slow())
        for i, output in enumerate(outputs):
            await deliver(server.registry, [(rid, output, i == len(outputs) - 1)])
            await asyncio.sleep(0)
        await reading
        writer.close()
    assert await parsed(bytes(raw)) == b"".join(sse(o) for o in outputs) + DONE
    assert server.registry.in_flight == 0


async def test_an_http_1_0_stream_is_written_whole_and_unchunked(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /s HTTP/1.0\r\nHost: t\r\n\r\n")
        rid = await server.opened.get()
        for n in range(50):
            server.registry.deliver(rid, {"n": n}, finished=n == 49)
            await asyncio.sleep(0)
        raw = await reader.read()
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert body == b"".join(sse({"n": n}) for n in range(50)) + DONE


async def read_slowly(server: Server, target: str, until: Awaitable[None]) -> bytes:
    """GET ``target`` with a tiny receive window and read it 4 KiB at a time, so that
    the server's transport holds bytes back now and then; the raw response."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    raw = bytearray()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        await loop.sock_sendall(sock, http_get(target))
        producing = asyncio.ensure_future(until)
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = await loop.sock_recv(sock, 4096)
            assert data, bytes(raw[-200:])
            raw.extend(data)
            await asyncio.sleep(0)
        await producing
    finally:
        sock.close()
    return bytes(raw)


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_transform_shapes_each_output_once_when_the_client_falls_behind(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    # A transform that takes a field out of the output it is given (a common shaping):
    # run twice on one output, it would fail the second time.
    def without_secret(output: dict[str, Any]) -> dict[str, Any]:
        del output["secret"]
        return output

    deliver = SHAPES[shape]
    server = await serve(transform=without_secret)
    count = 40
    outputs = [{"i": i, "t": "z" * (300_000 if i % 2 == 0 else 10)} for i in range(count)]

    async def produce() -> None:
        rid = await server.opened.get()
        for i, output in enumerate(outputs):
            await deliver(server.registry, [(rid, {**output, "secret": i}, i == count - 1)])
            await asyncio.sleep(0)

    async with asyncio.timeout(BOUND * 3):
        raw = await read_slowly(server, "/s", produce())
    assert await parsed(raw) == b"".join(sse(o) for o in outputs) + DONE
    assert not server.aborted


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_shutdown_mid_stream_ends_each_stream_with_its_outputs_one_error_and_the_end(
    serve: Callable[..., Awaitable[Server]], shape: str
) -> None:
    deliver = SHAPES[shape]
    server = await serve(drain_timeout=0.2)
    clients = 4
    async with asyncio.timeout(BOUND):
        connections = [await open_stream(server) for _ in range(clients)]
        rids = [await server.opened.get() for _ in range(clients)]
        readings = [asyncio.create_task(strict_response(reader)) for reader, _ in connections]
        for n in range(5):
            await deliver(server.registry, [(rid, {"n": n}, False) for rid in rids])
            await asyncio.sleep(0)
        assert server.stop is not None
        await server.stop()
        results = await asyncio.gather(*readings)
        for _, writer in connections:
            writer.close()
    outputs = numbered(5)
    for _, _, chunks in results:
        body = b"".join(chunks)
        assert_outputs_then_one_error(body, outputs, 503)
    assert sorted(server.aborted) == sorted(rids)
    assert server.registry.in_flight == 0


async def test_a_client_gone_while_a_megabyte_output_is_being_written_aborts_the_work_once(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await open_stream(server)
        rid = await server.opened.get()
        server.registry.deliver(rid, {"n": 0})
        await reader.readuntil(b'{"n":0}')
        server.registry.deliver(rid, {"big": "q" * 5_000_000})
        await reader.readexactly(100_000)
        writer.transport.abort()
        await server.until_aborted()
        for n in range(1, 20):  # (late outputs for the gone client: counted, never raised)
            server.registry.deliver(rid, {"n": n})
        await server.handlers_ended()
    assert server.aborted == [rid]
    assert server.registry.in_flight == 0


async def test_pipelined_streams_on_one_connection_each_get_their_exact_response(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        one = b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n"
        writer.write(one + b"HEAD /s HTTP/1.1\r\nHost: t\r\n\r\n" + one)
        for round_ in range(2):
            rid = await server.opened.get()
            reading = asyncio.create_task(strict_response(reader))
            for n in range(20):
                server.registry.deliver(rid, {"r": round_, "n": n}, finished=n == 19)
                await asyncio.sleep(0)
            _, _, chunks = await reading
            assert (
                b"".join(chunks) == b"".join(sse({"r": round_, "n": n}) for n in range(20)) + DONE
            )
            if round_ == 0:  # the HEAD between them: headers alone
                await server.opened.get()
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
    assert server.registry.in_flight == 0
    assert len(server.aborted) == 1


async def test_a_transform_that_aborts_its_own_request_ends_it_once_with_the_outputs_before(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    # A content filter: the output it refuses aborts the request, from inside the write.
    held: dict[str, Any] = {}

    def censor(output: dict[str, Any]) -> dict[str, Any]:
        if output.get("stop"):
            held["registry"].abort(held["rid"])
        return output

    server = await serve(transform=censor)
    held["registry"] = server.registry
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        held["rid"] = rid
        await deliver_numbered(server.registry, rid, 3)
        server.registry.deliver(rid, {"stop": True})
        server.registry.deliver(rid, {"n": "after"}, finished=True)
        _, _, chunks = await reading
        writer.close()
        await server.handlers_ended()
    body = b"".join(chunks)
    outputs = numbered(3)
    assert body.startswith(outputs), body
    assert b'"after"' not in body
    assert body.endswith(DONE), body
    assert server.aborted == [rid]
    assert server.registry.in_flight == 0


async def test_a_client_gone_before_the_status_line_aborts_the_work_once(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        _, writer = await open_stream(server)
        rid = await server.opened.get()
        writer.transport.abort()
        await server.until_aborted()
        assert not server.registry.deliver(rid, {"n": 0})  # late: counted, never raised
        await server.handlers_ended()
    assert server.aborted == [rid]
    assert server.registry.in_flight == 0
    assert server.registry.stats().aborted == {str(tether.AbortReason.CLIENT_DISCONNECTED): 1}


async def test_the_last_output_delivered_before_a_handler_is_cancelled_reaches_the_client(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    server = await serve()
    async with asyncio.timeout(BOUND):
        writer, rid, reading = await start_reading(server)
        await deliver_numbered(server.registry, rid, 3)
        # The engine's last output, then the server's shutdown cancels the handler,
        # in the same step (aiohttp cancels what still runs past its shutdown timeout).
        server.registry.deliver(rid, {"n": "last"}, finished=True)
        _, chunks = await cancel_the_handler(server, reading)
        writer.close()
    body = b"".join(chunks)
    outputs = b"".join(sse({"n": n}) for n in [0, 1, 2, "last"])
    assert body.startswith(outputs), body
    assert body.endswith(DONE), body
    assert server.registry.in_flight == 0
