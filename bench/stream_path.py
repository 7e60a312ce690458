"""The CPU of one streamed event on the Starlette path, in process.

``python -m bench.stream_path``: as :mod:`bench.json_path`, with ``/stream``: each
request streams the shared producer's 64 outputs as SSE events and ends. Figures
are microseconds of process CPU per event, the median of ``--reps`` interleaved
runs. Variants: ``raw`` (the hand-off: Starlette's ``StreamingResponse`` over the
hand-written table, as in the HTTP benchmark) and ``tether`` (``TetherMiddleware``
and ``respond(..., streaming=True)``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

import tether
import tether_starlette

from .json_path import CONCURRENCY, OUTPUTS, one_request
from .servers.common import raw_sse
from .servers.producer import SSE_HEADERS, Producer, RawTable

__all__ = ["build", "main"]


def build(variant: str) -> tuple[ASGIApp, Producer]:
    """The app of ``variant`` and the producer it reads (not started)."""
    producer = Producer()
    if variant == "raw":
        raw = RawTable(lambda rid: None)
        producer.sink = raw.deliver

        async def raw_stream(request: Request) -> Response:
            box = raw.open()
            producer.add(box.rid, OUTPUTS)
            return StreamingResponse(
                raw_sse(raw, box), media_type="text/event-stream", headers=SSE_HEADERS
            )

        return Starlette(routes=[Route("/json", raw_stream)]), producer
    registry = tether.Registry(lambda rid: None)
    producer.sink = registry.deliver

    async def tether_stream(request: Request) -> Response:
        stream = registry.open()
        producer.add(stream.rid, OUTPUTS)
        return await tether_starlette.respond(request, stream, streaming=True)

    app = Starlette(routes=[Route("/json", tether_stream)])
    return tether_starlette.TetherMiddleware(app, registry=registry), producer


async def measure(variant: str, requests: int) -> float:
    """Microseconds of process CPU per event over ``requests`` (after a warm-up)."""
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
        await run(requests // 10)
        return await run(requests) / (requests * OUTPUTS) * 1e6
    finally:
        task.cancel()
        await asyncio.wait([task])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3_000)
    args = parser.parse_args(argv)
    variants = ["raw", "tether"]
    runs: dict[str, list[float]] = {variant: [] for variant in variants}
    for rep in range(args.reps):
        for variant in variants[rep % 2 :] + variants[: rep % 2]:
            runs[variant].append(asyncio.run(measure(variant, args.requests)))
    base = statistics.median(runs["raw"])
    print(f"streaming path in process: {OUTPUTS} events per request, {CONCURRENCY} at once")
    for variant in variants:
        value = statistics.median(runs[variant])
        spread = f"{min(runs[variant]):.2f}-{max(runs[variant]):.2f}"
        print(f"  {variant:8s} {value:6.2f} us/event ({spread}), {value / base:.2f}x")


if __name__ == "__main__":
    main()
