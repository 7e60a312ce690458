"""Core microbenchmark: tether's registry and streams against hand-written tables.

Run from the repository root, with the project's virtual environment::

    .venv/bin/python -m bench.core            # N in 1, 100, 1000, 10000; 3 repetitions
    .venv/bin/python -m bench.core --sizes 10000 --reps 5 --loops uvloop
    .venv/bin/python -m bench.core --observability   # collector and tracing costs
    .venv/bin/python -m bench.core --write    # what make bench runs: results kept
    .venv/bin/python -m bench.core --sizes 10000 --reps 9 --cpu --merge with,without

The workload, for each N: N requests open at once, each read by its own task
with ``async for``; a producer emits one output to every live request per step,
64 steps, the last output finishing (and freeing) each request; the producer
yields to the loop after each step. The figure is outputs per second over the
whole run (open, deliver, read, free). Implementations run interleaved, each
repetition in a fresh event loop, and the medians are reported with the ratios
tether/baseline, on asyncio's loop and on uvloop's (``--loops``). It also reports
tracemalloc's memory per open idle ``Stream``. ``--cpu`` counts outputs per CPU
second of the process instead (on a shared machine, wall time counts the other
jobs). ``--merge with`` runs the with-merge workload instead (``with,without``:
both): the registry is built with a ``merge`` (list concatenation; each output is
a one-item list) and the producer delivers two outputs to every request before
it yields, so that every reader is behind at every wake-up and reads the two
merged into one; the baselines fold with the same ``merge`` where they can (the
figure still counts outputs delivered). Baselines: ``core_baselines.py``
beside this file; the last, (d), is the floor: the least a table with tether's reading
API can do, so that tether over it is what tether's guarantees cost. ``--write`` keeps
the figures in ``bench/results/core.json`` (which :mod:`bench.charts` draws) and their
table between the ``core:begin`` / ``core:end`` markers of ``bench/RESULTS.md``.

``--observability`` runs the same workload on tether alone against tether with a
Prometheus collector attached (scraped once at the end of each run), with
OpenTelemetry tracing attached but no SDK (disabled: the global provider is the
API's no-op), and with tracing enabled (an SDK provider, every span sampled and
ended, no exporter: the cost of tracing itself, not of shipping spans).
These figures are outputs per CPU second of the process, the best of the runs,
steadier than wall-time medians on a shared machine. ``--outputs`` sets the
outputs per request: observers cost per request, so fewer outputs per request
show more of their cost.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import prometheus_client
from opentelemetry.sdk.trace import TracerProvider

import tether
import tether_otel
import tether_prometheus

from .core_baselines import EventTable, FloorTable, QueueTable, SlotTable
from .report import RESULTS, rewrite_readme

OUTPUTS_PER_REQUEST = 64
"""Changed by ``--outputs``."""


async def _drain(reader: AsyncIterator[Any]) -> int:
    count = 0
    async for _ in reader:
        count += 1
    return count


async def _drain_merged(reader: AsyncIterator[list[Any]]) -> int:
    count = 0
    async for outputs in reader:
        count += len(outputs)
    return count


def _concat(older: list[Any], newer: list[Any]) -> list[Any]:
    return older + newer


async def run_tether(n: int, registry: tether.Registry | None = None) -> int:
    registry = registry or tether.Registry()
    streams = [registry.open() for _ in range(n)]
    return await _produce(registry.deliver, [s.rid for s in streams], [_drain(s) for s in streams])


async def run_tether_merged(n: int) -> int:
    registry = tether.Registry(merge=_concat)
    streams = [registry.open() for _ in range(n)]
    readers = [_drain_merged(s) for s in streams]
    return await _produce(registry.deliver, [s.rid for s in streams], readers, merged=True)


def _baseline(
    table_type: type[EventTable | SlotTable | QueueTable | FloorTable], *, merged: bool = False
) -> Runner:
    async def run(n: int) -> int:
        table = table_type(_concat) if merged else table_type()
        opened = [table.open() for _ in range(n)]

        def deliver(rid: str, output: Any, *, finished: bool) -> None:
            table.deliver(rid, output, finished)

        drain = _drain_merged if merged else _drain
        readers = [drain(r) for _, r in opened]
        return await _produce(deliver, [rid for rid, _ in opened], readers, merged=merged)

    return run


async def _produce(
    deliver: Callable[..., object],
    rids: list[str],
    readers: list[Coroutine[Any, Any, int]],
    *,
    merged: bool = False,
) -> int:
    """Deliver the outputs, yielding to the loop after every step (``merged``: after
    every second step, each output a one-item list, so that the readers are behind)."""
    tasks = [asyncio.create_task(reader) for reader in readers]
    await asyncio.sleep(0)  # every reader starts and parks, as handlers would
    last = OUTPUTS_PER_REQUEST - 1
    for step in range(OUTPUTS_PER_REQUEST):
        finished = step == last
        output = [step] if merged else step
        for rid in rids:
            deliver(rid, output, finished=finished)
        if merged and step % 2 == 0 and not finished:
            continue  # the readers fall behind: the next output merges with this one
        await asyncio.sleep(0)  # one engine step: the readers run
    counts = await asyncio.gather(*tasks)
    total = sum(counts)
    if total != len(rids) * OUTPUTS_PER_REQUEST:
        raise RuntimeError(f"lost outputs: {total} of {len(rids) * OUTPUTS_PER_REQUEST}")
    return total


Runner = Callable[[int], Coroutine[Any, Any, int]]


async def run_prometheus(n: int) -> int:
    registry = tether.Registry()
    collector = tether_prometheus.RegistryCollector()
    collector.add(registry)
    outputs = await run_tether(n, registry)
    prometheus_client.generate_latest(_OneCollector(collector))  # one scrape per run
    return outputs


class _OneCollector:
    """A collector registry of one collector (generate_latest reads ``collect()``)."""

    def __init__(self, collector: Any) -> None:
        self._collector = collector

    def collect(self) -> Any:
        return self._collector.collect()


async def run_tracing_disabled(n: int) -> int:
    registry = tether.Registry()
    tether_otel.instrument(registry)  # the global provider: the API's no-op
    return await run_tether(n, registry)


async def run_tracing_enabled(n: int) -> int:
    registry = tether.Registry()
    tether_otel.instrument(registry, tracer_provider=TracerProvider())
    return await run_tether(n, registry)


def _with_prometheus(registry: tether.Registry) -> None:
    tether_prometheus.RegistryCollector().add(registry)


def _with_tracing_disabled(registry: tether.Registry) -> None:
    tether_otel.instrument(registry)


def _with_tracing_enabled(registry: tether.Registry) -> None:
    tether_otel.instrument(registry, tracer_provider=TracerProvider())


HOOKS: dict[str, Callable[[tether.Registry], None]] = {
    "+prometheus": _with_prometheus,
    "+otel disabled": _with_tracing_disabled,
    "+otel enabled": _with_tracing_enabled,
}


def per_request_cost(count: int = 20_000, reps: int = 15) -> dict[str, float]:
    """Nanoseconds each observer variant adds to one request's open, first output
    and end (its only hooks), measured alone: ``count`` requests opened, finished by
    one output and dropped, best of ``reps`` CPU-time runs, variants interleaved.

    A small, steady figure where a whole-workload ratio drowns it in noise; divide
    it by a request's share of the workload to get the overhead."""

    async def one(attach: Callable[[tether.Registry], None] | None) -> float:
        registry = tether.Registry()
        if attach is not None:
            attach(registry)
        open_, deliver = registry.open, registry.deliver
        gc.collect()
        started = time.process_time()
        for _ in range(count):
            deliver(open_().rid, None, finished=True)
        return (time.process_time() - started) / count * 1e9

    variants: dict[str, Callable[[tether.Registry], None] | None] = {"tether": None, **HOOKS}
    best = dict.fromkeys(variants, math.inf)
    for _ in range(reps):
        for name, attach in variants.items():
            best[name] = min(best[name], asyncio.run(one(attach)))
    return {name: best[name] - best["tether"] for name in HOOKS} | {"tether": best["tether"]}


OBSERVABILITY: dict[str, Runner] = {
    "tether": run_tether,
    "+prometheus": run_prometheus,
    "+otel disabled": run_tracing_disabled,
    "+otel enabled": run_tracing_enabled,
}

IMPLEMENTATIONS: dict[str, Runner] = {
    "tether": run_tether,
    "a:event+wait_for": _baseline(EventTable),
    "b:merging-slot": _baseline(SlotTable),
    "c:queue": _baseline(QueueTable),
    "d:floor": _baseline(FloorTable),
}

MERGED: dict[str, Runner] = {
    "tether": run_tether_merged,
    "a:event+wait_for": _baseline(EventTable, merged=True),
    "b:merging-slot": _baseline(SlotTable, merged=True),
    "c:queue": _baseline(QueueTable, merged=True),
    "d:floor": _baseline(FloorTable, merged=True),
}
"""The with-merge workload (``--merge with``): the same names, so the same ratios."""


LOOPS: dict[str, Callable[[], Callable[[], asyncio.AbstractEventLoop] | None]] = {
    "asyncio": lambda: None,
    "uvloop": lambda: __import__("uvloop").new_event_loop,
}
"""Loop name to its factory (``None``: asyncio's own), imported only when asked for."""


def measure(
    runner: Runner,
    n: int,
    clock: Callable[[], float] = time.perf_counter,
    loop: str = "asyncio",
) -> float:
    """Outputs per second of one run in a fresh event loop, by ``clock``."""
    gc.collect()
    with asyncio.Runner(loop_factory=LOOPS[loop]()) as runner_:
        started = clock()
        outputs = runner_.run(runner(n))
        elapsed = clock() - started
    return outputs / elapsed


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
    global OUTPUTS_PER_REQUEST
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,100,1000,10000", help="comma-separated N")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per N (median)")
    parser.add_argument("--loops", default="asyncio,uvloop", help="comma-separated loop names")
    parser.add_argument(
        "--observability", action="store_true", help="tether with collectors and tracing"
    )
    parser.add_argument("--outputs", type=int, default=OUTPUTS_PER_REQUEST)
    parser.add_argument(
        "--cpu", action="store_true", help="outputs per CPU second of the process (see above)"
    )
    parser.add_argument(
        "--merge", default="without", help="workloads: without, with, or with,without"
    )
    parser.add_argument("--write", action="store_true", help="keep the figures (see above)")
    args = parser.parse_args()
    OUTPUTS_PER_REQUEST = args.outputs
    sizes = [int(size) for size in args.sizes.split(",")]
    loops = args.loops.split(",")
    workloads = args.merge.split(",")
    if args.observability or not set(workloads) <= {"with", "without"}:
        workloads = ["without"]
    # Costs of a few percent drown in a shared machine's wall-clock noise: the
    # observability runs count the process's CPU time (one thread: the loop's).
    cpu = args.cpu or args.observability
    clock = time.process_time if cpu else time.perf_counter
    # ... and keep each variant's best run, as timeit does: what slows a run down on
    # a busy machine (another process's cache traffic, a late GC) is not the variant's.
    summary = max if args.observability else statistics.median
    names = list(OBSERVABILITY if args.observability else IMPLEMENTATIONS)

    python = f"Python {platform.python_version()} on {platform.machine()}"
    print(f"{python}; tether {tether.__version__}; load average {os.getloadavg()[0]:.2f}")
    command = " ".join(["python -m bench.core", *sys.argv[1:]])
    print(f"command: {command}")
    unit = "per CPU second" if cpu else "per second"
    kind = "best" if args.observability else "medians"
    print(f"{OUTPUTS_PER_REQUEST} outputs per request, {unit}; {kind} of {args.reps} runs")
    header = f"{'N':>6} | " + " | ".join(f"{name:>16}" for name in names)
    header += " | " + " | ".join(
        f"{name}/tether" if args.observability else f"tether/{name[0]}" for name in names[1:]
    )
    verdicts: list[str] = []
    results: dict[str, dict[str, dict[str, float]]] = {}
    for loop in loops:
        for workload in workloads:
            implementations = (
                OBSERVABILITY
                if args.observability
                else (MERGED if workload == "with" else IMPLEMENTATIONS)
            )
            title = loop if workload == "without" else f"{loop}, with merge"
            print(f"\n{title} loop\n{header}\n{'-' * len(header)}")
            for n in sizes:
                samples: dict[str, list[float]] = {name: [] for name in names}
                reps = args.reps if n > 1 else max(args.reps, 50)  # N=1 is too short to time once
                for rep in range(reps):
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in order:
                        samples[name].append(measure(implementations[name], n, clock, loop))
                medians = {name: summary(values) for name, values in samples.items()}
                results.setdefault(title, {})[str(n)] = medians
                if args.observability:
                    ratios = [medians[name] / medians["tether"] for name in names[1:]]
                else:
                    ratios = [medians["tether"] / medians[name] for name in names[1:]]
                row = f"{n:>6} | " + " | ".join(f"{medians[name]:>14,.0f}/s" for name in names)
                row += " | " + " | ".join(f"{ratio:>7.2f}x" for ratio in ratios)
                print(row, flush=True)
                if n == TARGET_N and not args.observability:
                    verdicts.extend(f"{title}: {line}" for line in _verdicts(samples))
    if args.observability:
        costs = per_request_cost()
        print(f"\none request alone (open, one finishing output, end): {costs['tether']:,.0f} ns")
        for name in HOOKS:
            print(f"  {name}: +{costs[name]:,.0f} ns per request")
        return
    idle = idle_stream_bytes()
    print(f"\nmemory per open idle Stream: {idle:.0f} bytes (tracemalloc)")
    for line in verdicts:
        print(line)
    if args.write:
        _write(results, idle, command, args.reps, unit)


def _write(
    results: dict[str, dict[str, dict[str, float]]],
    idle: float,
    command: str,
    reps: int,
    unit: str = "per second",
) -> None:
    """``bench/results/core.json`` and the core block of ``bench/RESULTS.md``."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    meta = {"date": date, "command": command, "load": load, "reps": reps, "idle_bytes": idle}
    path = RESULTS.parent / "results" / "core.json"
    path.write_text(json.dumps({"meta": meta, "loops": results}, indent=1) + "\n")
    names = list(IMPLEMENTATIONS)
    lines = [
        "## Core: the registry against hand-written tables",
        "",
        f"`{command}`, {date}, load average {load:.2f}; outputs {unit}, medians of "
        f"{reps} interleaved runs (50 at N = 1), and tether's ratio to each baseline; "
        f"{idle:.0f} bytes per open idle `Stream`. Workload and baselines: "
        "[FINDINGS.md](FINDINGS.md#core-microbenchmark-benchcorepy).",
        "",
        "| loop | N | "
        + " | ".join([*names, *(f"tether / {name[0]}" for name in names[1:])])
        + " |",
        "|" + "---|" * (2 + 2 * len(names) - 1),
    ]
    for loop, sizes in results.items():
        for n, medians in sizes.items():
            cells = [f"{medians[name]:,.0f}" for name in names]
            cells += [f"{medians['tether'] / medians[name]:.2f}x" for name in names[1:]]
            lines.append(f"| {loop} | {int(n):,} | " + " | ".join(cells) + " |")
    rewrite_readme(RESULTS, "\n".join([*lines, ""]), begin=CORE_BEGIN, end=CORE_END)
    print(f"{path.relative_to(RESULTS.parent.parent)} written; bench/RESULTS.md rewritten")


CORE_BEGIN, CORE_END = "<!-- core:begin -->", "<!-- core:end -->"
TARGET_N = 10_000
TARGETS = {"b:merging-slot": 1.25, "a:event+wait_for": 2.0}
"""Issue 12's targets at N = 10,000: tether's outputs/s over each baseline's, at least."""


def _verdicts(samples: dict[str, list[float]]) -> list[str]:
    """One line per target of :data:`TARGETS`, met or missed, by the median of the
    repetitions' paired ratios (each repetition runs every implementation once, back
    to back), with their spread."""
    lines = []
    for name, target in TARGETS.items():
        paired = sorted(t / b for t, b in zip(samples["tether"], samples[name], strict=True))
        ratio = statistics.median(paired)
        verdict = "met" if ratio >= target else "MISSED"
        lines.append(
            f"target at N = {TARGET_N:,}: tether / {name} >= {target}x: {ratio:.2f}x "
            f"(paired, {len(paired)} repetitions, {paired[0]:.2f}-{paired[-1]:.2f}), {verdict}"
        )
    return lines


if __name__ == "__main__":
    main()
