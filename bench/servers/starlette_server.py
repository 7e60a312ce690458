"""A Starlette benchmark server under uvicorn (httptools), in one of the variants of
:mod:`bench.servers.common`.

Run ``python -m bench.servers.starlette_server --variant tether [--loop uvloop]``: it binds
127.0.0.1 on a free port, prints ``PORT <n>``, and serves the routes listed in
:mod:`bench.servers.common` until it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from .common import (
    POLL_TIMEOUT,
    Backend,
    interleave,
    limit_events,
    listen,
    parse_args,
    raw_sse,
    serve,
)
from .handoff import SERIALIZERS, events
from .producer import SSE_DONE, SSE_HEADERS, prebuilt_result, sse_many

__all__ = ["build"]


def _int(request: Request, name: str, default: int) -> int:
    return int(request.query_params.get(name, default))


def _raw_routes(backend: Backend) -> list[Route]:
    raw, producer = backend.raw, backend.producer

    def sse(chunks: AsyncIterator[bytes]) -> Response:
        return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)

    async def stream(request: Request) -> Response:
        box = raw.open(request.query_params.get("rid"))
        producer.add(box.rid, _int(request, "n", 64))
        return sse(raw_sse(raw, box))

    async def idle(request: Request) -> Response:
        box = raw.open()
        producer.add(box.rid, 1, hold=True)
        return sse(raw_sse(raw, box))

    async def json(request: Request) -> Response:
        box = raw.open(request.query_params.get("rid"))
        producer.add(box.rid, _int(request, "n", 64))
        try:
            result = await box.result()
        finally:
            raw.close(box)
        return Response(orjson.dumps(result), media_type="application/json")

    async def batch(request: Request) -> Response:
        boxes = [raw.open() for _ in range(_int(request, "b", 64))]
        for box in boxes:
            producer.add(box.rid, _int(request, "n", 64))
        return sse(interleave(raw, boxes))

    return [
        Route("/stream", stream),
        Route("/idle", idle),
        Route("/json", json),
        Route("/batch", batch),
    ]


def _handoff_routes(backend: Backend) -> list[Route]:
    """Issue 26's hand-off: a queue per stream, a future per JSON request."""
    queues, futures, shape = backend.queues, backend.futures, backend.shape

    async def stream(request: Request) -> Response:
        query = request.query_params
        rid, queue = queues.open(query.get("rid"))
        shape(query.get("shape", "step")).add(rid, int(query.get("n", 64)))
        body = events(queues, rid, queue, SERIALIZERS[query.get("json", "orjson")])
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

    async def answer(request: Request) -> Response:
        query = request.query_params
        rid, future = futures.open(query.get("rid"))
        shape(query.get("shape", "step"), "json").add(rid, int(query.get("n", 64)))
        try:
            result = await future
        finally:
            futures.close(rid)
        dumps = SERIALIZERS[query.get("json", "orjson")]
        return Response(dumps(result), media_type="application/json")

    async def json(request: Request) -> Response:
        if request.query_params.get("watch") != "1":
            return await answer(request)
        # ``watch=1``: the disconnect watch inference servers write by hand around a
        # handler (vLLM's way): the answer in a task, a second task reading
        # ``receive`` until the disconnect, the first of them to end wins; a client
        # that leaves cancels the answer, whose ``finally`` aborts the request.
        answering = asyncio.ensure_future(answer(request))
        gone = asyncio.ensure_future(_until_disconnect(request))
        done, _ = await asyncio.wait((answering, gone), return_when=asyncio.FIRST_COMPLETED)
        answering.cancel()
        gone.cancel()
        return answering.result() if answering in done else Response(status_code=499)

    return [Route("/stream", stream), Route("/json", json)]


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _limit_routes(backend: Backend) -> list[Route]:
    """Starlette's own responses over bytes that are already there: no producer."""

    async def stream(request: Request) -> Response:
        events = limit_events(_int(request, "n", 64))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def json(request: Request) -> Response:
        return Response(prebuilt_result(_int(request, "n", 64)), media_type="application/json")

    return [Route("/stream", stream), Route("/json", json)]


def _poll_routes(backend: Backend) -> list[Route]:
    raw, producer = backend.raw, backend.producer

    async def woken(request: Request, event: asyncio.Event) -> bool:
        """Wait for the producer or the poll timeout; ``False`` if the client is gone."""
        try:
            await asyncio.wait_for(event.wait(), timeout=POLL_TIMEOUT)
        except TimeoutError:
            pass
        event.clear()
        return not await request.is_disconnected()

    async def stream(request: Request) -> Response:
        await request.body()  # else the first is_disconnected() eats the body message
        box = raw.open(request.query_params.get("rid"))
        box.event = event = asyncio.Event()
        producer.add(box.rid, _int(request, "n", 64))

        async def body() -> AsyncIterator[bytes]:
            try:
                while not box.finished or box.items:
                    if box.items:
                        items, box.items = box.items, []
                        yield sse_many(items)
                    elif not await woken(request, event):
                        return
                yield SSE_DONE
            finally:
                raw.close(box)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def json(request: Request) -> Response:
        await request.body()
        box = raw.open(request.query_params.get("rid"))
        box.event = event = asyncio.Event()
        box.collect = True
        producer.add(box.rid, _int(request, "n", 64))
        try:
            while not box.finished:
                if not await woken(request, event):
                    return Response(status_code=499)
            return Response(orjson.dumps(box.last), media_type="application/json")
        finally:
            raw.close(box)

    return [Route("/stream", stream), Route("/json", json)]


def _tether_routes(backend: Backend) -> list[Route]:
    import tether_starlette

    registry, producer, shape = backend.registry, backend.producer, backend.shape
    encoders = backend.encoders

    async def stream(request: Request) -> Response:
        query = request.query_params
        source = registry.open(query.get("rid"))
        shape(query.get("shape", "step")).add(source.rid, int(query.get("n", 64)))
        encoder = encoders[query.get("json", "orjson")]
        return await tether_starlette.respond(request, source, streaming=True, encoder=encoder)

    async def idle(request: Request) -> Response:
        source = registry.open()
        producer.add(source.rid, 1, hold=True)
        return await tether_starlette.respond(request, source, streaming=True)

    async def json(request: Request) -> Response:
        query = request.query_params
        source = registry.open(query.get("rid"))
        shape(query.get("shape", "step"), "json").add(source.rid, int(query.get("n", 64)))
        encoder = encoders[query.get("json", "orjson")]
        return await tether_starlette.respond(request, source, streaming=False, encoder=encoder)

    async def batch(request: Request) -> Response:
        source = registry.open_batch(_int(request, "b", 64))
        for rid in source.rids:
            producer.add(rid, _int(request, "n", 64))
        return await tether_starlette.respond(request, source, streaming=True)

    return [
        Route("/stream", stream),
        Route("/idle", idle),
        Route("/json", json),
        Route("/batch", batch),
    ]


def build(backend: Backend) -> ASGIApp:
    """The ASGI app of ``backend.variant``, with the abort log at ``/_bench/aborts``
    and the collector's time at ``/_bench/gc``."""

    async def aborts(request: Request) -> Response:
        return Response(orjson.dumps(backend.aborts.take()), media_type="application/json")

    async def gc(request: Request) -> Response:
        return Response(orjson.dumps(backend.gc.read()), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with backend.running():
            yield

    routes = {
        "raw": _raw_routes,
        "handoff": _handoff_routes,
        "poll": _poll_routes,
        "tether": _tether_routes,
        "limit": _limit_routes,
    }[backend.variant]
    bench = [Route("/_bench/aborts", aborts), Route("/_bench/gc", gc)]
    app = Starlette(routes=[*routes(backend), *bench], lifespan=lifespan)
    if backend.variant == "tether":
        import tether_starlette

        # No send wrapper here needs a task at all: the producer may drive send, an
        # engine thread's hand-over too (asked only of a tree that offers it: bench.ab
        # runs earlier revisions too).
        middleware = tether_starlette.TetherMiddleware
        option = inspect.signature(middleware).parameters.get("producer_writes")
        writes = option is not None and ("threads" if "threads" in str(option) else True)
        options = {"producer_writes": writes} if writes else {}
        return middleware(app, registry=backend.registry, **options)
    return app


def main() -> None:
    args = parse_args(__doc__ or "")
    app = build(Backend(args.variant, args.tick))
    config = uvicorn.Config(
        app, lifespan="on", http="httptools", log_level="warning", access_log=False
    )
    serve(uvicorn.Server(config).serve(sockets=[listen()]), args.loop)


if __name__ == "__main__":
    main()
