"""Runs every HTTP benchmark and rewrites their section of ``bench/README.md``.

``python -m bench.run`` (what ``make bench`` calls) starts each server and each
load client as its own subprocess on 127.0.0.1, stops servers by process id, and
repeats every measurement (raw and tether interleaved, their order alternating
between repetitions) so that a noisy neighbour hits both sides alike. The raw
results go to ``bench/results/http.json``; the tables, medians with min-max and
the tether/raw ratios, go between the ``http:begin``/``http:end`` markers of the
README. ``--quick`` is a seconds-long smoke run that writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import report

__all__ = ["FULL", "QUICK", "Profile", "main"]

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOG = ROOT / "bench" / "results" / "servers.log"


@dataclasses.dataclass(frozen=True)
class Profile:
    """How long and how wide every benchmark runs."""

    reps: int
    concurrency: tuple[int, ...]
    duration: float
    tries: int
    streams: int
    batch_concurrency: tuple[int, ...] = (1,)

    def warmup(self, concurrency: int) -> float:
        # 512 streams start in one wave; let it break up before measuring
        return 1.0 if concurrency >= 256 else 0.5 if self.duration >= 1 else 0.2


FULL = Profile(reps=3, concurrency=(1, 64, 512), duration=1.5, tries=50, streams=2000)
QUICK = Profile(reps=1, concurrency=(1, 16), duration=0.4, tries=8, streams=100)

FRAMEWORKS = ("starlette", "aiohttp")
THROUGHPUT_VARIANTS = ("raw", "tether", "limit")
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


@contextlib.contextmanager
def server(framework: str, variant: str, *extra: str) -> Iterator[tuple[int, str]]:
    """Start a benchmark server; yield its pid and base URL; stop it by pid."""
    LOG.parent.mkdir(parents=True, exist_ok=True)
    module = f"bench.servers.{framework}_server"
    with LOG.open("a") as log:
        log.write(f"--- {module} --variant {variant} {' '.join(extra)}\n")
        log.flush()
        proc = subprocess.Popen(
            [PYTHON, "-m", module, "--variant", variant, *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"{module} did not start (see {LOG}): {line!r}")
        yield proc.pid, f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM by pid, then SIGKILL if it lingers."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def client(mode: str, url: str, *options: object) -> dict[str, Any]:
    """Run the load client once in its own process; its one JSON line of results."""
    argv = [PYTHON, "-m", "bench.client", mode, url, *map(str, options)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"client failed: {' '.join(argv)}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _order(rep: int, variants: tuple[str, ...]) -> tuple[str, ...]:
    """Every variant once, rotated by one each repetition (two: alternating)."""
    shift = rep % len(variants)
    return variants[shift:] + variants[:shift]


def throughput(profile: Profile, out: dict[str, Any]) -> None:
    """Streaming and non-streaming runs against the hand-off (``raw``), tether and
    no-hand-off (``limit``) servers; batch runs against the first two."""
    for rep in range(profile.reps):
        for framework in FRAMEWORKS:
            for variant in _order(rep, THROUGHPUT_VARIANTS):
                with server(framework, variant) as (pid, base):
                    for conc in profile.concurrency:
                        common = ("--concurrency", conc, "--server-pid", pid)
                        timing = ("--warmup", profile.warmup(conc), "--duration", profile.duration)
                        key = f"{framework}/{variant}/{conc}"
                        stream = client(
                            "stream", f"{base}/stream?n=64", *common, *timing, "--expect", 64
                        )
                        out["stream"].setdefault(key, []).append(stream)
                        answer = client("json", f"{base}/json?n=64", *common, *timing)
                        out["json"].setdefault(key, []).append(answer)
                    if variant == "limit":
                        continue  # no sub-requests without a producer
                    for conc in profile.batch_concurrency:
                        key = f"{framework}/{variant}/{conc}"
                        batch = client(
                            "stream",
                            f"{base}/batch?b=64&n=64",
                            *("--concurrency", conc, "--server-pid", pid, "--expect", 64 * 64),
                            *("--warmup", profile.warmup(conc), "--duration", profile.duration),
                        )
                        out["batch"].setdefault(key, []).append(batch)
                print(f"  throughput rep {rep + 1}: {framework}/{variant} done", flush=True)


def disconnect(profile: Profile, out: dict[str, Any]) -> None:
    """Close-to-``on_abort`` times, streaming and not, per setup."""
    for rep in range(profile.reps):
        for framework, variant, label, extra in DISCONNECT_SETUPS:
            with server(framework, variant, "--tick", "0.01", *extra) as (_, base):
                for mode in ("stream", "json"):
                    # the polling baseline wakes every 4 s: spread closes over that period
                    delay = 4.0 if variant == "poll" and mode == "json" else 0.1
                    options: list[object] = ["--tries", profile.tries, "--max-delay", delay]
                    if mode == "stream":
                        options.append("--streaming")
                    result = client("abort", f"{base}/{mode}?n=1000000", *options)
                    out["disconnect"].setdefault(f"{label}/{mode}", []).append(result)
        print(f"  disconnect rep {rep + 1} done", flush=True)


def memory(profile: Profile, out: dict[str, Any]) -> None:
    """Server memory per idle open stream, each in a fresh server process."""
    for rep in range(profile.reps):
        for framework in FRAMEWORKS:
            for variant in _order(rep, ("raw", "tether")):
                with server(framework, variant) as (pid, base):
                    result = client(
                        "idle", f"{base}/idle", "--streams", profile.streams, "--server-pid", pid
                    )
                out["memory"].setdefault(f"{framework}/{variant}", []).append(result)
        print(f"  memory rep {rep + 1} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short smoke run; writes nothing")
    parser.add_argument(
        "--only",
        choices=["throughput", "disconnect", "memory"],
        action="append",
        help="run a subset",
    )
    args = parser.parse_args(argv)
    profile = QUICK if args.quick else FULL
    started = time.time()
    out: dict[str, Any] = {"stream": {}, "json": {}, "batch": {}, "disconnect": {}, "memory": {}}
    benchmarks = {"throughput": throughput, "disconnect": disconnect, "memory": memory}
    for name in args.only or benchmarks:
        print(f"{name}...", flush=True)
        benchmarks[name](profile, out)
    out["meta"] = report.environment(
        profile=dataclasses.asdict(profile),
        command=" ".join(["python -m bench.run", *(argv if argv is not None else sys.argv[1:])]),
        seconds=time.time() - started,
    )
    text = report.render(out)
    if args.quick:
        print(text)
        return 0
    results = ROOT / "bench" / "results" / "http.json"
    results.write_text(json.dumps(out, indent=1) + "\n")
    report.rewrite_readme(ROOT / "bench" / "README.md", text)
    print(f"HTTP benchmarks done in {time.time() - started:.0f} s; bench/README.md rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
