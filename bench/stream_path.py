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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

import tether
import tether_starlette

from .json_path import CONCURRENCY, OUTPUTS, compare, cpu_per_request, print_runs
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
    """Microseconds of process CPU per event."""
    return await cpu_per_request(build, variant, requests) / OUTPUTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3_000)
    args = parser.parse_args(argv)
    runs = compare(measure, ["raw", "tether"], reps=args.reps, requests=args.requests)
    title = f"streaming path in process: {OUTPUTS} events per request, {CONCURRENCY} at once"
    print_runs(title, runs, "us/event", 2)


if __name__ == "__main__":
    main()
