"""Runs the HTTP benchmarks beside the matrix and rewrites their section of
``bench/RESULTS.md``: batch streaming, disconnect to abort, memory per idle stream.

``python -m bench.run`` (what ``make bench`` calls, after :mod:`bench.matrix`, which
measures streaming and JSON throughput) starts each server and each load client as
its own subprocess on 127.0.0.1, stops servers by process id, and repeats every
measurement (the raw and tether servers interleaved, their order rotating between
repetitions) so that a noisy neighbour hits both sides alike; the servers of one
repetition share a hash seed (``PYTHONHASHSEED``), and every server runs with glibc's
malloc thresholds pinned (``bench.processes.MALLOC_ENV`` says why). The raw results
go to ``bench/results/http.json``; the tables, medians with min-max and the
tether/raw ratios, go between the ``http:begin``/``http:end`` markers.
``--profile`` adds py-spy profiles of tether and the hand-off at 64 clients
(:mod:`bench.profiling`), which go between the ``profile:begin``/``profile:end``
markers. ``--quick`` is a seconds-long smoke run that writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import profiling, report
from .processes import FRAMEWORKS, ROOT, client, server

__all__ = ["FULL", "QUICK", "Plan", "main"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long and how wide every benchmark runs."""

    reps: int
    duration: float
    tries: int
    streams: int
    batch_concurrency: tuple[int, ...] = (1,)

    def warmup(self) -> float:
        return 0.5 if self.duration >= 1 else 0.2


FULL = Plan(reps=3, duration=1.5, tries=50, streams=2000)
QUICK = Plan(reps=1, duration=0.4, tries=8, streams=100)

DISCONNECT_SETUPS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("starlette", "tether", "tether + Starlette (uvicorn)", ()),
    ("aiohttp", "tether", "tether + aiohttp, handler_cancellation=False", ()),
    (
        "aiohttp",
        "tether",
        "tether + aiohttp, handler_cancellation=True",
        ("--handler-cancellation",),
    ),
    ("starlette", "poll", "polling baseline, Starlette (uvicorn)", ()),
    ("aiohttp", "poll", "polling baseline, aiohttp, handler_cancellation=False", ()),
)


def _order(rep: int, variants: tuple[str, ...]) -> tuple[str, ...]:
    """Every variant once, rotated by one each repetition (two: alternating)."""
    shift = rep % len(variants)
    return variants[shift:] + variants[:shift]


def batch(plan: Plan, out: dict[str, Any]) -> None:
    """Batch streaming against the hand-written interleave (``raw``)."""
    for rep in range(plan.reps):
        for framework in FRAMEWORKS:
            for variant in _order(rep, ("raw", "tether")):
                # one hash seed per repetition, the same for every variant: paired
                with server(framework, variant, seed=rep + 1) as (pid, base):
                    for conc in plan.batch_concurrency:
                        key = f"{framework}/{variant}/{conc}"
                        result = client(
                            "stream",
                            f"{base}/batch?b=64&n=64",
                            *("--concurrency", conc, "--server-pid", pid, "--expect", 64 * 64),
                            *("--warmup", plan.warmup(), "--duration", plan.duration),
                        )
                        out["batch"].setdefault(key, []).append(result)
        print(f"  batch rep {rep + 1} done", flush=True)


def disconnect(plan: Plan, out: dict[str, Any]) -> None:
    """Close-to-``on_abort`` times, streaming and not, per setup."""
    for rep in range(plan.reps):
        for framework, variant, label, extra in DISCONNECT_SETUPS:
            with server(framework, variant, "--tick", "0.01", *extra) as (_, base):
                for mode in ("stream", "json"):
                    # the polling baseline wakes every 4 s: spread closes over that period
                    delay = 4.0 if variant == "poll" and mode == "json" else 0.1
                    options: list[object] = ["--tries", plan.tries, "--max-delay", delay]
                    if mode == "stream":
                        options.append("--streaming")
                    result = client("abort", f"{base}/{mode}?n=1000000", *options)
                    out["disconnect"].setdefault(f"{label}/{mode}", []).append(result)
        print(f"  disconnect rep {rep + 1} done", flush=True)


def memory(plan: Plan, out: dict[str, Any]) -> None:
    """Server memory per idle open stream, each in a fresh server process."""
    for rep in range(plan.reps):
        for framework in FRAMEWORKS:
            for variant in _order(rep, ("raw", "tether")):
                with server(framework, variant, seed=rep + 1) as (pid, base):
                    result = client(
                        "idle", f"{base}/idle", "--streams", plan.streams, "--server-pid", pid
                    )
                out["memory"].setdefault(f"{framework}/{variant}", []).append(result)
        print(f"  memory rep {rep + 1} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run; writes nothing")
    parser.add_argument(
        "--only",
        choices=["batch", "disconnect", "memory", "profile"],
        action="append",
        help="run a subset",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile tether and the hand-off at 64 clients with py-spy (bench/profiling.py)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    command = " ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])])
    benchmarks = {"batch": batch, "disconnect": disconnect, "memory": memory}
    names = list(args.only or benchmarks)
    if args.profile and "profile" not in names:
        names.append("profile")
    if "profile" in names:
        profiling.require_py_spy()  # before minutes of other benchmarks, not after
    started = time.time()
    out: dict[str, Any] = {"batch": {}, "disconnect": {}, "memory": {}}
    for name in names:
        if name in benchmarks:
            print(f"{name}...", flush=True)
            benchmarks[name](plan, out)
    if any(name in benchmarks for name in names):
        out["meta"] = report.environment(
            profile=dataclasses.asdict(plan), command=command, seconds=time.time() - started
        )
        if not args.quick:
            keep_earlier(out, [name for name in names if name in benchmarks])
        _publish(report.render(out), out, "http.json", report.BEGIN, report.END, quick=args.quick)
    if "profile" in names:
        print("profile...", flush=True)
        window = 2.0 if args.quick else 5.0
        profiles: dict[str, Any] = {"runs": profiling.profile(window)}
        profiles["meta"] = report.environment(command=command, window=window)
        text = profiling.render(profiles["runs"], profiles["meta"])
        _publish(text, profiles, "profile.json", profiling.BEGIN, profiling.END, quick=args.quick)
    print(f"benchmarks done in {time.time() - started:.0f} s", flush=True)
    return 0


def keep_earlier(out: dict[str, Any], ran: list[str], path: Path | None = None) -> None:
    """A run of some benchmarks (``--only``) keeps the others' recorded results, each
    with the date it was measured (``meta["sections"]``), instead of dropping them."""
    path = path or ROOT / "bench" / "results" / "http.json"
    if not path.exists():
        return
    earlier = json.loads(path.read_text())
    earlier_meta = earlier.get("meta", {})
    dates = dict(earlier_meta.get("sections", {}))
    for name in ("batch", "disconnect", "memory"):
        if name in ran:
            dates[name] = out["meta"]["date"]
        elif earlier.get(name):
            out[name] = earlier[name]
            dates.setdefault(name, earlier_meta.get("date", "an earlier run"))
    out["meta"]["sections"] = dates


def _publish(
    text: str, results: dict[str, Any], name: str, begin: str, end: str, *, quick: bool
) -> None:
    """Print a quick run's tables; keep a full run's results and rewrite its README block."""
    if quick:
        print(text, flush=True)
        return
    (ROOT / "bench" / "results" / name).write_text(json.dumps(results, indent=1) + "\n")
    report.rewrite_readme(report.RESULTS, text, begin=begin, end=end)
    print(f"bench/results/{name} written; bench/RESULTS.md rewritten between {begin}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
