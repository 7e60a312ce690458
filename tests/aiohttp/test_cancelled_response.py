"""A handler cancelled while its client is still connected (aiohttp does so to the
handlers still running past ``shutdown_timeout``; a middleware's timeout may too)
ends its response, then lets the cancellation go on."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.typedefs import Handler

from .conftest import Env, build_app, raw_request, read_until, sse_events, start_default_server

BOUND = 10.0


class HandlerTasks:
    """Keeps the task of every handler (through :meth:`middleware`), so that a test
    can cancel one."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[object]] = []
        self.started = asyncio.Event()

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            self.tasks.append(task)
            self.started.set()
            return await handler(request)

        self.middleware = middleware


def dechunked(body: bytes) -> tuple[bytes, bool]:
    """The payload of a chunked HTTP body, and whether its last chunk arrived."""
    payload = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return payload, True
        payload, body = payload + rest[:size], rest[size + 2 :]
    return payload, False


async def cancelled_mid_request(env: Env, target: str, marker: bytes) -> tuple[bytes, bool]:
    """Serve the test app, send ``target``, cancel its handler once ``marker`` arrived
    (``b""``: once the handler runs), and return everything the client read and
    whether the handler's task ended cancelled."""
    app = build_app(env)
    handlers = HandlerTasks()
    app.middlewares.append(handlers.middleware)
    runner, port = await start_default_server(app)
    try:
        async with asyncio.timeout(BOUND):
            reader, writer = await raw_request(port, target)
            seen = await read_until(reader, marker) if marker else b""
            await handlers.started.wait()
            await env.tracker.until(lambda: bool(env.tracker.opened))
            (task,) = handlers.tasks
            task.cancel()
            seen += await reader.read()  # to the end: aiohttp closes after a cancellation
            await asyncio.wait([task])
            writer.close()
        return seen, task.cancelled()
    finally:
        await runner.cleanup()


async def test_a_stream_cancelled_mid_stream_ends_with_an_error_event_and_the_terminal_frame(
    env: Env,
) -> None:
    seen, cancelled = await cancelled_mid_request(env, "/?n=1&end=hold", b'"0.0"')

    assert cancelled, "the cancellation was swallowed"
    head, _, body = seen.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    payload, complete = dechunked(body)
    assert complete
    events = sse_events(payload)
    assert events[0] == {"text": "0.0"}
    assert events[-2]["error"]["code"] == 503
    assert events[-1] == "[DONE]"
    assert env.registry.in_flight == 0
    assert list(env.tracker.aborted) == env.tracker.opened


async def test_a_json_wait_cancelled_gets_a_json_error_status(env: Env) -> None:
    seen, cancelled = await cancelled_mid_request(env, "/?streaming=0&end=hold", b"")

    assert cancelled, "the cancellation was swallowed"
    head, _, body = seen.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    assert json.loads(body)["error"]["code"] == 503
    assert env.registry.in_flight == 0
    assert list(env.tracker.aborted) == env.tracker.opened
