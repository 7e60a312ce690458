"""An aiohttp benchmark server, in one of the variants of :mod:`bench.servers.common`.

Run ``python -m bench.servers.aiohttp_server --variant tether [--loop uvloop]
[--handler-cancellation]``:
it binds 127.0.0.1 on a free port, prints ``PORT <n>``, and serves the routes listed
in :mod:`bench.servers.common` until it gets SIGTERM or SIGINT. Handler
cancellation is off unless asked for, as in ``web.run_app`` and ``AppRunner``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncGenerator, AsyncIterator

import orjson
from aiohttp import web

from . import common
from .common import POLL_TIMEOUT, Backend, interleave, limit_events, listen, parse_args, raw_sse
from .handoff import SERIALIZERS, events
from .producer import SSE_DONE, SSE_HEADERS, prebuilt_result, sse_many

__all__ = ["build"]

_SSE = {"content-type": "text/event-stream", **SSE_HEADERS}


def _int(request: web.Request, name: str, default: int) -> int:
    return int(request.query.get(name, default))


async def _write_all(request: web.Request, chunks: AsyncIterator[bytes]) -> web.StreamResponse:
    """Stream ``chunks`` as the framework's own ``StreamResponse``; a gone client ends it."""
    response = web.StreamResponse(headers=_SSE)
    try:
        await response.prepare(request)
        async for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the chunks' finally aborted the work
    return response


def _raw_routes(backend: Backend) -> list[web.RouteDef]:
    raw, producer = backend.raw, backend.producer

    async def stream(request: web.Request) -> web.StreamResponse:
        box = raw.open(request.query.get("rid"))
        producer.add(box.rid, _int(request, "n", 64))
        chunks = raw_sse(raw, box)
        try:
            return await _write_all(request, chunks)
        finally:
            await chunks.aclose()

    async def idle(request: web.Request) -> web.StreamResponse:
        box = raw.open()
        producer.add(box.rid, 1, hold=True)
        chunks = raw_sse(raw, box)
        try:
            return await _write_all(request, chunks)
        finally:
            await chunks.aclose()

    async def json(request: web.Request) -> web.StreamResponse:
        box = raw.open(request.query.get("rid"))
        producer.add(box.rid, _int(request, "n", 64))
        try:
            result = await box.result()
        finally:
            raw.close(box)
        return web.Response(body=orjson.dumps(result), content_type="application/json")

    async def batch(request: web.Request) -> web.StreamResponse:
        boxes = [raw.open() for _ in range(_int(request, "b", 64))]
        for box in boxes:
            producer.add(box.rid, _int(request, "n", 64))
        chunks = interleave(raw, boxes)
        try:
            return await _write_all(request, chunks)
        finally:
            await chunks.aclose()

    return [
        web.get("/stream", stream),
        web.get("/idle", idle),
        web.get("/json", json),
        web.get("/batch", batch),
    ]


def _handoff_routes(backend: Backend) -> list[web.RouteDef]:
    """Issue 26's hand-off: a queue per stream, a future per JSON request."""
    queues, futures, shape = backend.queues, backend.futures, backend.shape

    async def stream(request: web.Request) -> web.StreamResponse:
        query = request.query
        rid, queue = queues.open(query.get("rid"))
        shape(query.get("shape", "step")).add(rid, int(query.get("n", 64)))
        chunks = events(queues, rid, queue, SERIALIZERS[query.get("json", "orjson")])
        try:
            return await _write_all(request, chunks)
        finally:
            await chunks.aclose()

    async def json(request: web.Request) -> web.StreamResponse:
        query = request.query
        rid, future = futures.open(query.get("rid"))
        shape(query.get("shape", "step"), "json").add(rid, int(query.get("n", 64)))
        try:
            result = await future
        finally:
            futures.close(rid)
        dumps = SERIALIZERS[query.get("json", "orjson")]
        return web.Response(body=dumps(result), content_type="application/json")

    return [web.get("/stream", stream), web.get("/json", json)]


def _limit_routes(backend: Backend) -> list[web.RouteDef]:
    """aiohttp's own responses over bytes that are already there: no producer."""

    async def stream(request: web.Request) -> web.StreamResponse:
        return await _write_all(request, limit_events(_int(request, "n", 64)))

    async def json(request: web.Request) -> web.StreamResponse:
        body = prebuilt_result(_int(request, "n", 64))
        return web.Response(body=body, content_type="application/json")

    return [web.get("/stream", stream), web.get("/json", json)]


def _poll_routes(backend: Backend) -> list[web.RouteDef]:
    raw, producer = backend.raw, backend.producer

    async def woken(request: web.Request, event: asyncio.Event) -> bool:
        """Wait for the producer or the poll timeout; ``False`` if the client is gone."""
        try:
            await asyncio.wait_for(event.wait(), timeout=POLL_TIMEOUT)
        except TimeoutError:
            pass
        event.clear()
        transport = request.transport
        return transport is not None and not transport.is_closing()

    async def stream(request: web.Request) -> web.StreamResponse:
        box = raw.open(request.query.get("rid"))
        box.event = event = asyncio.Event()
        producer.add(box.rid, _int(request, "n", 64))

        async def body() -> AsyncGenerator[bytes, None]:
            while not box.finished or box.items:
                if box.items:
                    items, box.items = box.items, []
                    yield sse_many(items)
                elif not await woken(request, event):
                    return
            yield SSE_DONE

        chunks = body()
        try:
            return await _write_all(request, chunks)
        finally:
            await chunks.aclose()
            raw.close(box)

    async def json(request: web.Request) -> web.StreamResponse:
        box = raw.open(request.query.get("rid"))
        box.event = event = asyncio.Event()
        box.collect = True
        producer.add(box.rid, _int(request, "n", 64))
        try:
            while not box.finished:
                if not await woken(request, event):
                    return web.Response(status=499)
            return web.Response(body=orjson.dumps(box.last), content_type="application/json")
        finally:
            raw.close(box)

    return [web.get("/stream", stream), web.get("/json", json)]


def _tether_routes(backend: Backend) -> list[web.RouteDef]:
    import tether_aiohttp

    registry, producer, shape = backend.registry, backend.producer, backend.shape
    encoders = backend.encoders

    async def stream(request: web.Request) -> web.StreamResponse:
        query = request.query
        source = registry.open(query.get("rid"))
        shape(query.get("shape", "step")).add(source.rid, int(query.get("n", 64)))
        encoder = encoders[query.get("json", "orjson")]
        return await tether_aiohttp.respond(request, source, streaming=True, encoder=encoder)

    async def idle(request: web.Request) -> web.StreamResponse:
        source = registry.open()
        producer.add(source.rid, 1, hold=True)
        return await tether_aiohttp.respond(request, source, streaming=True)

    async def json(request: web.Request) -> web.StreamResponse:
        query = request.query
        source = registry.open(query.get("rid"))
        shape(query.get("shape", "step"), "json").add(source.rid, int(query.get("n", 64)))
        encoder = encoders[query.get("json", "orjson")]
        return await tether_aiohttp.respond(request, source, streaming=False, encoder=encoder)

    async def batch(request: web.Request) -> web.StreamResponse:
        source = registry.open_batch(_int(request, "b", 64))
        for rid in source.rids:
            producer.add(rid, _int(request, "n", 64))
        return await tether_aiohttp.respond(request, source, streaming=True)

    return [
        web.get("/stream", stream),
        web.get("/idle", idle),
        web.get("/json", json),
        web.get("/batch", batch),
    ]


def build(backend: Backend) -> web.Application:
    """The application of ``backend.variant``, with the abort log at ``/_bench/aborts``
    and the collector's time at ``/_bench/gc``."""

    async def aborts(request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(backend.aborts.take()), content_type="application/json"
        )

    async def gc(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(backend.gc.read()), content_type="application/json")

    async def producer_ctx(app: web.Application) -> AsyncIterator[None]:
        async with backend.running():
            yield

    app = web.Application()
    routes = {
        "raw": _raw_routes,
        "handoff": _handoff_routes,
        "poll": _poll_routes,
        "tether": _tether_routes,
        "limit": _limit_routes,
    }[backend.variant]
    app.add_routes([*routes(backend), web.get("/_bench/aborts", aborts), web.get("/_bench/gc", gc)])
    app.cleanup_ctx.append(producer_ctx)
    if backend.variant == "tether":
        import tether_aiohttp

        tether_aiohttp.setup(app, backend.registry)
    return app


async def serve(app: web.Application, *, handler_cancellation: bool) -> None:
    """Serve on the printed loopback port until SIGTERM or SIGINT."""
    # A short shutdown: raw idle handlers never notice their client left (no write,
    # no cancellation), and would hold the default 60 s drain.
    runner = web.AppRunner(
        app, handler_cancellation=handler_cancellation, access_log=None, shutdown_timeout=1.0
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        # SockSite listens again with its own backlog (128 by default): 512 clients
        # connecting at once would overflow it into one-second SYN retries.
        await web.SockSite(runner, listen(), backlog=4096, shutdown_timeout=1.0).start()
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    args = parse_args(__doc__ or "")
    app = build(Backend(args.variant, args.tick))
    common.serve(serve(app, handler_cancellation=args.handler_cancellation), args.loop)


if __name__ == "__main__":
    main()
