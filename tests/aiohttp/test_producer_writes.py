"""Outputs written from the producer's step (a parked stream on an idle transport):
they reach the socket inside ``deliver()``; a failure there ends that response as the
handler's own write loop would, and never reaches the producer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
from aiohttp import web

import tether
import tether_aiohttp
from tests._support.stalled import http_get

from .conftest import StartServer, chunked_body, read_until, sse_events

BOUND: Final = 10.0


def one_stream_app(
    registry: tether.Registry,
    opened: asyncio.Queue[str],
    writes: list[bytes] | None = None,
    ping_interval: float = 15.0,
) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if writes is not None and isinstance(transport, asyncio.Transport):
            write = transport.write

            def noted(data: Any) -> None:  # what reaches the socket, and when
                writes.append(bytes(data))
                write(data)

            transport.write = noted  # type: ignore[method-assign]
        stream = registry.open()
        opened.put_nowait(stream.rid)
        return await tether_aiohttp.respond(
            request, stream, streaming=True, ping_interval=ping_interval
        )

    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.router.add_get("/one", handle)
    return app


@contextlib.asynccontextmanager
async def one_stream(
    start_server: StartServer, registry: tether.Registry, writes: list[bytes]
) -> AsyncIterator[tuple[str, asyncio.StreamReader]]:
    """A GET of ``/one`` on a real server, bounded: its stream's rid and the client's reader."""
    opened: asyncio.Queue[str] = asyncio.Queue()
    port = await start_server(one_stream_app(registry, opened, writes))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            writer.write(http_get("/one"))
            yield await opened.get(), reader
    finally:
        writer.close()
        await writer.wait_closed()


async def test_the_head_goes_with_the_first_output_and_the_last_with_the_end_in_one_send(
    start_server: StartServer,
) -> None:
    registry = tether.Registry()
    writes: list[bytes] = []
    async with one_stream(start_server, registry, writes) as (rid, reader):
        assert registry.deliver(rid, {"n": 0})
        await read_until(reader, b'{"n":0}')
        assert registry.deliver(rid, {"n": 1}, finished=True)
        await read_until(reader, b"\r\n0\r\n\r\n")
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b'f\r\ndata: {"n":0}\n\n\r\n'
    # the last output, the terminal frame and the end of the body: one send as well
    assert writes[1:] == [b'1d\r\ndata: {"n":1}\n\ndata: [DONE]\n\n\r\n0\r\n\r\n']


async def test_outputs_go_out_inside_deliver_and_an_unencodable_one_ends_with_an_error_event(
    start_server: StartServer,
) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    writes: list[bytes] = []
    async with one_stream(start_server, registry, writes) as (rid, reader):
        assert registry.deliver(rid, {"n": 0})
        seen = await read_until(reader, b'{"n":0}')
        # The handler is parked now: the output reaches the socket inside deliver(),
        # before anything else runs (no task of the handler's was woken for it).
        written = len(writes)
        assert registry.deliver(rid, {"n": 1})
        assert writes[written:] == [b'f\r\ndata: {"n":1}\n\n\r\n']
        seen += await read_until(reader, b'{"n":1}')
        assert registry.deliver(rid, object())  # not JSON: never raised to the producer
        seen += await read_until(reader, b"\r\n0\r\n\r\n")
    events = sse_events(chunked_body(seen))
    assert events[:2] == [{"n": 0}, {"n": 1}]
    assert events[2]["error"]["code"] == 500
    assert events[3:] == ["[DONE]"]
    assert aborted == [rid]
    assert registry.in_flight == 0


async def test_a_stream_the_producer_keeps_writing_gets_a_keep_alive_only_once_silent(
    start_server: StartServer,
) -> None:
    # The outputs go out from the producer's step while the handler sleeps; its idle
    # deadline must count from the last of them, not from when it went to sleep.
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    port = await start_server(one_stream_app(registry, opened, ping_interval=0.1))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            writer.write(http_get("/one"))
            rid = await opened.get()
            registry.deliver(rid, {"n": 0})
            seen = await read_until(reader, b'{"n":0}')
            for n in range(1, 31):  # the workload: an output every 10 ms, for 3 intervals
                await asyncio.sleep(0.01)
                registry.deliver(rid, {"n": n})
            seen += await read_until(reader, b'{"n":30}')
            assert b": ping" not in seen
            seen += await read_until(reader, b": ping")  # silent now: the keep-alive comes
            registry.deliver(rid, {"n": 31}, finished=True)
            seen += await read_until(reader, b"\r\n0\r\n\r\n")
    finally:
        writer.close()
        await writer.wait_closed()
    events = sse_events(chunked_body(seen))
    assert events == [{"n": n} for n in range(32)] + ["[DONE]"]
    assert registry.in_flight == 0


async def test_an_http_1_0_stream_is_written_unchunked_through_every_path(
    start_server: StartServer,
) -> None:
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    port = await start_server(one_stream_app(registry, opened))

    async def produce() -> None:
        rid = await opened.get()
        for n in range(50):  # one per step: the handler parks between them
            assert registry.deliver(rid, {"n": n}, finished=n == 49)
            await asyncio.sleep(0)

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            producer = asyncio.create_task(produce())
            writer.write(b"GET /one HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            raw = await reader.read()  # HTTP/1.0: the body ends with the connection
            await producer
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert sse_events(body) == [{"n": n} for n in range(50)] + ["[DONE]"]
    assert registry.in_flight == 0


@pytest.mark.both_loops
async def test_outputs_of_a_parked_stream_reach_the_socket_inside_deliver_on_every_loop(
    start_server: StartServer,
) -> None:
    # uvloop's transport subclasses nothing of asyncio's: the direct write must take it
    # all the same. Proof that deliver() itself wrote: the bytes are in the client's
    # socket before the loop runs again (the handler's own write needs its task to run).
    registry = tether.Registry()
    opened: asyncio.Queue[str] = asyncio.Queue()
    port = await start_server(one_stream_app(registry, opened))
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", port))
    try:
        client.setblocking(False)
        async with asyncio.timeout(BOUND):
            await loop.sock_sendall(client, http_get("/one"))
            rid = await opened.get()
            assert registry.deliver(rid, {"n": 0})
            seen = b""
            while b'{"n":0}' not in seen:
                data = await loop.sock_recv(client, 4096)
                assert data, seen
                seen += data
        frame = b'f\r\ndata: {"n":1}\n\n\r\n'
        assert registry.deliver(rid, {"n": 1})
        client.settimeout(BOUND)  # blocking, the loop held: only deliver() can have sent it
        got = b""
        while len(got) < len(frame):
            data = client.recv(len(frame) - len(got))
            assert data, got
            got += data
        assert got == frame
        seen += got
        client.setblocking(False)
        async with asyncio.timeout(BOUND):
            assert registry.deliver(rid, {"n": 2}, finished=True)
            while not seen.endswith(b"\r\n0\r\n\r\n"):
                data = await loop.sock_recv(client, 4096)
                assert data, seen
                seen += data
    finally:
        client.close()
    assert sse_events(chunked_body(seen)) == [{"n": 0}, {"n": 1}, {"n": 2}, "[DONE]"]
    assert registry.in_flight == 0
