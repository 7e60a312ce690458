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
import functools

from .json_path import CONCURRENCY, OUTPUTS, compare, cpu_per_request, print_runs
from .json_path import build as build_json

__all__ = ["build", "main"]

build = functools.partial(build_json, streaming=True)
"""The app of a variant (``raw``, ``tether``) and the producer it reads (not started)."""


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
