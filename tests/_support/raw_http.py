"""HTTP/1.1 over a raw TCP connection, for tests about what happens on one connection:
pipelined requests, a body sent in parts, a client that leaves part-way (or once the
server has taken its request). An HTTP client library would open a new connection
or refuse to pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

import pytest

BOUND: Final = 10.0
"""A generous bound on reading one response."""


def request(
    method: str, path: str, body: bytes = b"", *, length: int | None = None, json: bool = False
) -> bytes:
    """One HTTP/1.1 request; ``length`` announces a body that is sent separately."""
    size = len(body) if length is None else length
    kind = "content-type: application/json\r\n" if json else ""
    head = f"{method} {path} HTTP/1.1\r\nhost: test\r\n{kind}content-length: {size}\r\n\r\n"
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of the next response on the connection (bounded)."""
    async with asyncio.timeout(BOUND):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines)
        }
        if headers.get("transfer-encoding") != "chunked":
            return int(status_line.split()[1]), await reader.readexactly(
                int(headers.get("content-length", "0"))
            )
        body = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)  # the blank line after the last chunk (no trailers)
        return int(status_line.split()[1]), body


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A raw TCP connection to the server at ``url``, closed on exit if the test did not."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        await leave(writer)


async def leave(writer: asyncio.StreamWriter) -> float:
    """The client closes its connection; returns when it did (``time.perf_counter()``)."""
    left_at = time.perf_counter()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return left_at


async def send_then_leave(
    url: str, request: bytes, taken: asyncio.Event, aborted: asyncio.Event
) -> None:
    """Send ``request`` to ``url``, wait for ``taken``, drop the connection, and fail
    the test unless ``aborted`` is set within 2 s ("within milliseconds" is the promise)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)  # the kernel's buffers take it all
    async with asyncio.timeout(10):
        await taken.wait()
    writer.transport.abort()  # the client is gone
    try:
        async with asyncio.timeout(2):
            await aborted.wait()
    except TimeoutError:
        pytest.fail("the client left 2 s ago and its request is still in flight", pytrace=False)
