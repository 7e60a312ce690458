"""Requests that share one aiohttp connection each get their own RequestScope.

aiohttp runs every request's handler in a new task copied from the connection's
``start()`` task, whose context no request's middleware ever sets: the scope is
entered inside the handler task and reset when it ends. These tests pin that, with
pipelined requests and a request after a large upload on one raw connection, with
``handler_cancellation`` off (aiohttp's default) and on.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

import tether
import tether.http

from .conftest import Env, StartServer, build_app

BOUND = 10.0
ABORT_BOUND = 1.0
"""Seconds within which a client leaving must reach the producer's ``on_abort``."""


def scope_app(env: Env, seen: list[tether.RequestScope | None]) -> web.Application:
    """The test app, plus ``/scope`` (records the scope current in its handler) and
    ``/body`` (reads its whole body)."""
    app = build_app(env)

    async def scope(request: web.Request) -> web.Response:
        seen.append(tether.http.current_scope())
        return web.json_response({"n": len(seen)})

    async def body(request: web.Request) -> web.Response:
        return web.json_response({"size": len(await request.read())})

    app.router.add_get("/scope", scope)
    app.router.add_post("/body", body)
    return app


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the next response (with a Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines)
    }
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


async def test_pipelined_requests_each_see_their_own_scope(
    env: Env, start_server: StartServer
) -> None:
    seen: list[tether.RequestScope | None] = []
    port = await start_server(scope_app(env, seen))
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/scope") * 3)
        answers = [await read_response(reader) for _ in range(3)]
        writer.close()
        await writer.wait_closed()

    assert [(status, json.loads(body)) for status, _, body in answers] == [
        (200, {"n": 1}),
        (200, {"n": 2}),
        (200, {"n": 3}),
    ]
    assert all(scope is not None for scope in seen)
    assert len({id(scope) for scope in seen}) == 3


async def test_pipelined_json_requests_each_get_their_own_result(
    env: Env, start_server: StartServer
) -> None:
    port = await start_server(build_app(env))
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/?n=1&streaming=0") * 2)
        answers = [await read_response(reader) for _ in range(2)]
        writer.close()
        await writer.wait_closed()

    assert [status for status, _, _ in answers] == [200, 200]
    assert [headers["x-rid"] for _, headers, _ in answers] == env.tracker.opened
    assert env.tracker.aborted == {}
    assert env.registry.in_flight == 0


async def test_client_leaving_during_a_pipelined_request_aborts_that_request_alone(
    env: Env, start_server: StartServer
) -> None:
    tracker = env.tracker
    port = await start_server(build_app(env))
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/?n=1&streaming=0") + get("/?n=1&end=hold&streaming=0"))
        status, _, _ = await read_response(reader)
        await tracker.until(lambda: len(tracker.opened) == 2)
        writer.close()
        left_at = asyncio.get_running_loop().time()
        await tracker.until(lambda: len(tracker.aborted) == 1)
        await tracker.until(lambda: len(tracker.handled) == 2)
        await writer.wait_closed()

    second = tracker.opened[1]
    assert status == 200
    assert list(tracker.aborted) == [second]
    assert tracker.aborted[second] - left_at < ABORT_BOUND
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}
    assert env.registry.in_flight == 0


async def test_request_after_a_large_upload_on_the_same_connection_notices_its_client_leaving(
    env: Env, start_server: StartServer
) -> None:
    tracker = env.tracker
    upload = b"x" * (512 * 1024)  # past aiohttp's read buffer: reading pauses and resumes
    port = await start_server(scope_app(env, []))
    async with asyncio.timeout(BOUND):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = f"POST /body HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(upload)}\r\n\r\n"
        writer.write(head.encode() + upload)
        status, _, body = await read_response(reader)
        writer.write(get("/?n=1&end=hold&streaming=0"))
        await tracker.until(lambda: len(tracker.opened) == 1)
        writer.close()
        left_at = asyncio.get_running_loop().time()
        await tracker.until(lambda: len(tracker.aborted) == 1)
        await writer.wait_closed()

    assert (status, json.loads(body)) == (200, {"size": len(upload)})
    assert tracker.aborted[tracker.opened[0]] - left_at < ABORT_BOUND
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}


async def test_client_leaving_while_its_body_is_unread_aborts_the_work(
    env: Env, start_server: StartServer
) -> None:
    tracker = env.tracker
    segments = [b"a" * 1000, b"b" * 1000, b"c" * 1000]
    port = await start_server(build_app(env))
    async with asyncio.timeout(BOUND):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        # The handler waits for its result and never reads this body.
        target = "/?n=1&end=hold&streaming=0"
        head = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3000\r\n\r\n"
        writer.write(head.encode() + segments[0])
        await tracker.until(lambda: len(tracker.opened) == 1)
        for segment in segments[1:]:
            writer.write(segment)
            await writer.drain()
        writer.close()
        left_at = asyncio.get_running_loop().time()
        await tracker.until(lambda: len(tracker.aborted) == 1)
        await writer.wait_closed()

    assert tracker.aborted[tracker.opened[0]] - left_at < ABORT_BOUND
    assert dict(env.registry.stats().aborted) == {"client_disconnected": 1}
    assert env.registry.in_flight == 0
