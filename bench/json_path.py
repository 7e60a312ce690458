"""The CPU of one non-streaming (JSON) request on the Starlette path, in process.

``python -m bench.json_path`` drives the ASGI app directly, with a ``receive`` and
``send`` that behave as uvicorn's do for a GET (the request message at once, then
a disconnect once the response is complete), no sockets: what is left is the
Python work per request, steady enough to compare changes of a few microseconds,
which the HTTP benchmark's noise hides. Each request waits for the same producer
(`bench/servers/producer.py`, 64 outputs) and answers its last output as JSON;
64 requests run at once. Variants:

* ``raw``: a Starlette route over the hand-written table, as in the HTTP benchmark;
* ``manual``: ``TetherMiddleware`` and ``registry.open()`` + ``await
  stream.result()``, answered with Starlette's own ``Response`` (no ``respond()``);
* ``tether``: ``TetherMiddleware`` and ``respond(..., streaming=False)``.

Figures are microseconds of process CPU per request, the median of ``--reps``
interleaved runs, each in a fresh event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

import tether
import tether_starlette

from .servers.common import raw_sse
from .servers.producer import SSE_HEADERS, Producer, RawTable

__all__ = ["build", "compare", "cpu_per_request", "main", "measure", "one_request"]

OUTPUTS = 64
CONCURRENCY = 64
SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/json",
    "raw_path": b"/json",
    "query_string": b"",
    "root_path": "",
    "headers": [(b"host", b"127.0.0.1")],
    "client": ("127.0.0.1", 40000),
    "server": ("127.0.0.1", 8000),
}


def build(
    variant: str, *, streaming: bool = False, producer_writes: bool = False
) -> tuple[ASGIApp, Producer]:
    """The app of ``variant`` and the producer it waits on (not started): it answers
    every request with the last output as JSON, or (``streaming``) with every output as
    an SSE event (then no ``manual`` variant); ``producer_writes`` is the middleware's
    option of that name (a waiting stream written from the producer's step)."""
    producer = Producer()
    if variant == "raw":
        raw = RawTable(lambda rid: None)
        producer.sink = raw.deliver_many

        async def raw_json(request: Request) -> Response:
            box = raw.open()
            producer.add(box.rid, OUTPUTS)
            if streaming:
                sse = raw_sse(raw, box)
                return StreamingResponse(sse, media_type="text/event-stream", headers=SSE_HEADERS)
            try:
                result = await box.result()
            finally:
                raw.close(box)
            return Response(orjson.dumps(result), media_type="application/json")

        return Starlette(routes=[Route("/json", raw_json)]), producer
    registry = tether.Registry(lambda rid: None)
    producer.sink = registry.deliver_many

    async def manual_json(request: Request) -> Response:
        stream = registry.open()
        producer.add(stream.rid, OUTPUTS)
        async with stream:
            result = await stream.result()
        return Response(orjson.dumps(result), media_type="application/json")

    async def tether_json(request: Request) -> Response:
        stream = registry.open()
        producer.add(stream.rid, OUTPUTS)
        return await tether_starlette.respond(request, stream, streaming=streaming)

    handler = {"manual": manual_json, "tether": tether_json}[variant]
    app = Starlette(routes=[Route("/json", handler)])
    options = {"producer_writes": True} if producer_writes else {}  # (older trees lack it)
    return tether_starlette.TetherMiddleware(app, registry=registry, **options), producer


async def one_request(app: ASGIApp, sent: list[Message] | None = None) -> None:
    """One GET, with a server's ``receive``: the request at once, then
    ``http.disconnect`` once the response is complete; ``sent`` collects what the
    app sends (for tests). ``receive`` is an ``asyncio.Queue``'s ``get``, as
    hypercorn's is: a server's own ``receive``, which tether reads ahead without a
    task of its own, as it does uvicorn's."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    inbox.put_nowait({"type": "http.request", "body": b"", "more_body": False})

    async def send(message: Message) -> None:
        if sent is not None:
            sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            inbox.put_nowait({"type": "http.disconnect"})

    await app(dict(SCOPE), inbox.get, send)


Build = Callable[[str], tuple[ASGIApp, Producer]]
"""A variant's name to its app and the producer it waits on (not started)."""


async def cpu_per_request(build: Build, variant: str, requests: int) -> float:
    """Microseconds of process CPU per request of ``variant`` over ``requests``, after a
    warm-up, with :data:`CONCURRENCY` requests at once."""
    app, producer = build(variant)
    task = asyncio.create_task(producer.run())
    left = 0

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one_request(app)

    async def run(count: int) -> float:
        nonlocal left
        left = count
        start = time.process_time()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return time.process_time() - start

    try:
        await run(requests // 10)  # code paths and free lists
        return await run(requests) / requests * 1e6
    finally:
        task.cancel()
        await asyncio.wait([task])


async def measure(variant: str, requests: int) -> float:
    """Microseconds of process CPU per JSON request."""
    return await cpu_per_request(build, variant, requests)


def compare(
    measure: Callable[[str, int], Awaitable[float]],
    variants: list[str],
    *,
    reps: int,
    requests: int,
) -> dict[str, list[float]]:
    """Every variant ``reps`` times, interleaved (the order rotating), each run in a
    fresh event loop; the figures of each variant."""
    runs: dict[str, list[float]] = {variant: [] for variant in variants}
    for rep in range(reps):
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            runs[variant].append(asyncio.run(measure(variant, requests)))
    return runs


def print_runs(title: str, runs: dict[str, list[float]], unit: str, digits: int) -> None:
    """Each variant's median, range and ratio to the first variant's."""
    print(title)
    first = statistics.median(next(iter(runs.values())))
    for variant, values in runs.items():
        value = statistics.median(values)
        spread = f"{min(values):.{digits}f}-{max(values):.{digits}f}"
        print(f"  {variant:8s} {value:6.{digits}f} {unit} ({spread}), {value / first:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--variants", default="raw,manual,tether")
    args = parser.parse_args(argv)
    runs = compare(measure, args.variants.split(","), reps=args.reps, requests=args.requests)
    title = f"JSON path in process: {OUTPUTS} outputs per request, {CONCURRENCY} at once"
    print_runs(title, runs, "us/request", 1)


if __name__ == "__main__":
    main()
