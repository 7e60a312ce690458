"""Core microbenchmark: tether's registry and streams against three hand-written tables.

Run by hand from the repository root, with the project's virtual environment::

    .venv/bin/python bench/core.py            # N in 1, 100, 1000, 10000; 3 repetitions
    .venv/bin/python bench/core.py --sizes 10000 --reps 5

The workload, for each N: N requests open at once, each read by its own task
with ``async for``; a producer emits one output to every live request per step,
64 steps, the last output finishing (and freeing) each request; the producer
yields to the loop after each step. The figure is outputs per second over the
whole run (open, deliver, read, free). Implementations run interleaved, each
repetition in a fresh event loop, and the medians are reported with the ratios
tether/baseline. It also reports tracemalloc's memory per open idle ``Stream``.
Baselines: ``core_baselines.py`` beside this file.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from core_baselines import EventTable, QueueTable, SlotTable

import tether

OUTPUTS_PER_REQUEST = 64


async def _drain(reader: AsyncIterator[Any]) -> int:
    count = 0
    async for _ in reader:
        count += 1
    return count


async def run_tether(n: int) -> int:
    registry = tether.Registry()
    streams = [registry.open() for _ in range(n)]
    return await _produce(registry.deliver, [s.rid for s in streams], [_drain(s) for s in streams])


def _baseline(table_type: type[EventTable | SlotTable | QueueTable]) -> Runner:
    async def run(n: int) -> int:
        table = table_type()
        opened = [table.open() for _ in range(n)]

        def deliver(rid: str, output: Any, *, finished: bool) -> None:
            table.deliver(rid, output, finished)

        return await _produce(deliver, [rid for rid, _ in opened], [_drain(r) for _, r in opened])

    return run


async def _produce(
    deliver: Callable[..., object],
    rids: list[str],
    readers: list[Coroutine[Any, Any, int]],
) -> int:
    tasks = [asyncio.create_task(reader) for reader in readers]
    await asyncio.sleep(0)  # every reader starts and parks, as handlers would
    last = OUTPUTS_PER_REQUEST - 1
    for step in range(OUTPUTS_PER_REQUEST):
        finished = step == last
        for rid in rids:
            deliver(rid, step, finished=finished)
        await asyncio.sleep(0)  # one engine step: the readers run
    counts = await asyncio.gather(*tasks)
    total = sum(counts)
    if total != len(rids) * OUTPUTS_PER_REQUEST:
        raise RuntimeError(f"lost outputs: {total} of {len(rids) * OUTPUTS_PER_REQUEST}")
    return total


Runner = Callable[[int], Coroutine[Any, Any, int]]

IMPLEMENTATIONS: dict[str, Runner] = {
    "tether": run_tether,
    "a:event+wait_for": _baseline(EventTable),
    "b:merging-slot": _baseline(SlotTable),
    "c:queue": _baseline(QueueTable),
}


def measure(runner: Runner, n: int) -> float:
    """Outputs per second of one run in a fresh event loop."""
    gc.collect()
    started = time.perf_counter()
    outputs = asyncio.run(runner(n))
    return outputs / (time.perf_counter() - started)


def idle_stream_bytes(count: int = 10_000) -> float:
    """tracemalloc's bytes per open idle Stream (its state and table entry included)."""

    async def open_many() -> float:
        registry = tether.Registry()
        await registry.open().aclose()  # the first open binds the loop: not per stream
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        streams = [registry.open() for _ in range(count)]
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        # the list holding the streams is the benchmark's, not tether's
        grown -= sys.getsizeof(streams)
        for stream in streams:
            await stream.aclose()
        return grown / count

    return asyncio.run(open_many())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,100,1000,10000", help="comma-separated N")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per N (median)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    names = list(IMPLEMENTATIONS)

    python = f"Python {platform.python_version()} on {platform.machine()}"
    print(f"{python}; tether {tether.__version__}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{OUTPUTS_PER_REQUEST} outputs per request; medians of {args.reps} interleaved runs\n")
    header = f"{'N':>6} | " + " | ".join(f"{name:>16}" for name in names)
    header += " | tether/a | tether/b | tether/c"
    print(header)
    print("-" * len(header))
    verdicts: list[str] = []
    for n in sizes:
        samples: dict[str, list[float]] = {name: [] for name in names}
        reps = args.reps if n > 1 else max(args.reps, 50)  # N=1 is too short to time once
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                samples[name].append(measure(IMPLEMENTATIONS[name], n))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        ratios = [medians["tether"] / medians[name] for name in names[1:]]
        row = f"{n:>6} | " + " | ".join(f"{medians[name]:>14,.0f}/s" for name in names)
        row += " | " + " | ".join(f"{ratio:>7.2f}x" for ratio in ratios)
        print(row, flush=True)
        if n == TARGET_N:
            verdicts.extend(_verdicts(medians))
    print(f"\nmemory per open idle Stream: {idle_stream_bytes():.0f} bytes (tracemalloc)")
    for line in verdicts:
        print(line)


TARGET_N = 10_000
TARGETS = {"b:merging-slot": 1.25, "a:event+wait_for": 2.0}
"""Issue 12's targets at N = 10,000: tether's outputs/s over each baseline's, at least."""


def _verdicts(medians: dict[str, float]) -> list[str]:
    """One line per target of :data:`TARGETS`, met or missed."""
    lines = []
    for name, target in TARGETS.items():
        ratio = medians["tether"] / medians[name]
        verdict = "met" if ratio >= target else "MISSED"
        lines.append(
            f"target at N = {TARGET_N:,}: tether / {name} >= {target}x: {ratio:.2f}x, {verdict}"
        )
    return lines


if __name__ == "__main__":
    main()
