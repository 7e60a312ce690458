"""Where each benchmark server spends its time under load: py-spy samples, summarised.

``python -m bench.run --profile`` (what ``make bench`` calls) starts each server of
:data:`SETUPS` in turn, drives it with the load client at :data:`CLIENTS` clients,
and once the warm-up is over attaches ``py-spy record`` to the server's pid for the
measured window. py-spy samples from outside the process (no tracing hook slows
the code it measures) and leaves out idle samples (the loop waiting in ``epoll``),
so the shares are of the server's busy time. Each sample is charged to the
innermost Python frame (its *own* time) and, once, to every frame on its stack
(*inclusive* time); frames are grouped into areas by the package their file lies
in. Multiplied by the server CPU per event (or request) that the client measured
in the same window, a share becomes microseconds per event, which is what lets a
tether server be compared area by area with its baselines.

The raw stacks go to ``bench/results/profiles/`` (not kept in git), the summary to
``bench/results/profile.json``, the tables between the ``profile:begin`` and
``profile:end`` markers of ``bench/README.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import processes

__all__ = ["BEGIN", "CLIENTS", "END", "SETUPS", "Stacks", "areas_of", "profile", "render"]

BEGIN = "<!-- profile:begin -->"
END = "<!-- profile:end -->"
CLIENTS = 64
RATE = 200
"""Samples per second: py-spy's pause per sample stays around 1 % of the server's time."""

SETUPS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("task", "stream", "/stream?n=64&shape=task&json=orjson", ("tether", "handoff")),
    ("step", "stream", "/stream?n=64&shape=step&json=orjson", ("tether", "handoff")),
    ("json", "json", "/json?n=64&shape=step&json=orjson", ("tether", "handoff")),
)
"""``(name, client mode, path, variants)``: tether first, then the hand-off it is held
to (:mod:`bench.matrix`'s), streaming from a task per request and from an engine
step, and JSON; every server on uvloop."""
SETUP_TITLES = {
    "task": "streaming from a task per request",
    "step": "streaming from an engine step (`deliver_many`)",
    "json": "JSON, engine step",
}

PROFILES = processes.ROOT / "bench" / "results" / "profiles"
TOP = 12
"""Rows per table in the README."""
KEPT = 50
"""Functions kept per server in ``profile.json``: enough to find tether's top ones
in the baselines (what falls beyond is well under 1 % of a server's time)."""

Stacks = dict[tuple[tuple[str, str], ...], int]
"""``((function, file), ...)`` outermost first, to the number of samples."""


def _package_dir(name: str) -> str | None:
    """The directory of an importable package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations))) + os.sep


def areas_of() -> list[tuple[str, str]]:
    """``(directory prefix, area)``, most specific first: files are charged to the
    first prefix they start with, anything else to ``other``."""
    named = [
        ("tether", "tether core"),
        ("tether_starlette", "tether adapter"),
        ("tether_aiohttp", "tether adapter"),
        ("starlette", "starlette"),
        ("uvicorn", "uvicorn + httptools"),
        ("httptools", "uvicorn + httptools"),
        ("aiohttp", "aiohttp"),
        ("multidict", "aiohttp"),
        ("yarl", "aiohttp"),
        ("asyncio", "asyncio"),
    ]
    prefixes = [(path, area) for name, area in named if (path := _package_dir(name))]
    prefixes.append((str(processes.ROOT / "bench") + os.sep, "bench (handlers, producer)"))
    return sorted(prefixes, key=lambda item: -len(item[0]))


def area(file: str, prefixes: list[tuple[str, str]]) -> str:
    for prefix, name in prefixes:
        if file.startswith(prefix):
            return name
    return "other (stdlib, GC, ...)"


def parse(lines: Iterable[str]) -> Stacks:
    """py-spy's ``--format raw`` output (``frame;frame;... count``, each frame
    ``function (file)`` with ``--nolineno``) as :data:`Stacks`."""
    stacks: Stacks = collections.Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        trace, _, count = line.rpartition(" ")
        frames = []
        for frame in trace.split(";"):
            function, _, file = frame.rpartition(" (")
            frames.append((function, file.removesuffix(")")))
        stacks[tuple(frames)] += int(count)
    return dict(stacks)


@dataclasses.dataclass(frozen=True)
class Summary:
    """One profiled server: its load figures and where its busy samples went."""

    samples: int
    cost: float | None
    """Server CPU µs per event (streaming) or per request (JSON) in the same window."""
    areas: dict[str, float]
    """Area -> share of own time."""
    own: list[tuple[str, str, float]]
    """The :data:`KEPT` first functions by own time: ``(function, area, share)``."""
    layers: list[tuple[str, str, float]]
    """The top tether functions by inclusive time."""


def summarise(stacks: Stacks, cost: float | None, prefixes: list[tuple[str, str]]) -> Summary:
    total = sum(stacks.values()) or 1
    areas: collections.Counter[str] = collections.Counter()
    own: collections.Counter[tuple[str, str]] = collections.Counter()
    inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
    for frames, count in stacks.items():
        function, file = frames[-1]
        where = area(file, prefixes)
        areas[where] += count
        own[(function, where)] += count
        for seen in {(f, area(path, prefixes)) for f, path in frames}:
            if seen[1].startswith("tether"):
                inclusive[seen] += count
    return Summary(
        samples=sum(stacks.values()),
        cost=cost,
        areas={name: count / total for name, count in areas.most_common()},
        own=[(f, a, count / total) for (f, a), count in own.most_common(KEPT)],
        layers=[(f, a, count / total) for (f, a), count in inclusive.most_common(TOP)],
    )


def py_spy() -> str | None:
    """py-spy beside this interpreter (the venv's), else on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def require_py_spy() -> str:
    """py-spy's path, or an error that says how to install it."""
    spy = py_spy()
    if spy is None:
        raise RuntimeError("py-spy is not installed: `.venv/bin/python -m pip install py-spy`")
    return spy


def record(
    framework: str,
    variant: str,
    mode: str,
    path: str,
    seconds: float,
    *,
    name: str | None = None,
    into: Path = PROFILES,
) -> dict[str, Any]:
    """Profile one server (on uvloop) under :data:`CLIENTS` clients for ``seconds``;
    its raw stacks go to a file in ``into``."""
    spy = require_py_spy()
    into.mkdir(parents=True, exist_ok=True)
    stacks_file = into / f"{framework}-{name or mode}-{variant}.txt"
    warmup = 1.0
    gc_env = {"BENCH_GC": "1"}  # (the collector's own time: py-spy cannot tell it apart)
    with processes.server(framework, variant, "--loop", "uvloop", env=gc_env) as (pid, base):
        argv = [processes.PYTHON, "-m", "bench.client", mode, f"{base}{path}"]
        argv += [*("--concurrency", str(CLIENTS), "--server-pid", str(pid))]
        argv += [*("--warmup", str(warmup), "--duration", str(seconds))]
        if mode == "stream":
            argv += ["--expect", "64"]
        load = subprocess.Popen(
            argv,
            cwd=processes.ROOT,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=processes.pin_to("client"),
        )
        try:
            time.sleep(warmup)  # the client's own warm-up: sample its measured window
            spy_argv = [spy, "record", "--pid", str(pid), "--duration", str(round(seconds))]
            spy_argv += [*("--rate", str(RATE), "--format", "raw", "--output", str(stacks_file))]
            # Without --nonblocking py-spy stops the server for each sample, and a stop
            # lands in a system call about three times as often as its share of the
            # time (a loop of getpid() and Python work: 65 % of the samples for 35 % of
            # the time): the write and poll calls looked far heavier than they are.
            spy_argv += ["--full-filenames", "--nolineno", "--nonblocking"]
            gc_before = _gc_clock(base)
            spied = subprocess.run(spy_argv, capture_output=True, text=True, timeout=seconds + 60)
            if spied.returncode != 0:
                raise RuntimeError(
                    f"py-spy could not sample pid {pid} (attaching needs root or "
                    f"kernel.yama.ptrace_scope = 0): {spied.stderr.strip()}"
                )
            stdout, _ = load.communicate(timeout=seconds + 60)
            gc_after = _gc_clock(base)
        finally:
            if load.poll() is None:
                load.kill()
                load.wait()
    if load.returncode != 0:
        raise RuntimeError(f"client failed: {' '.join(argv)}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    cost_field = "server_cpu_us_per_event" if mode == "stream" else "server_cpu_us_per_request"
    with stacks_file.open() as file:
        summary = summarise(parse(file), result.get(cost_field), areas_of())
    gc: dict[str, Any] = {key: gc_after[key] - gc_before[key] for key in ("gc_s", "cpu_s")}
    pairs = zip(gc_after["collections"], gc_before["collections"], strict=True)
    gc["collections"] = [after - before for after, before in pairs]
    gc["share"] = gc["gc_s"] / gc["cpu_s"] if gc["cpu_s"] > 0 else 0.0
    return {"load": result, "stacks": stacks_file.name, "gc": gc, **dataclasses.asdict(summary)}


def _gc_clock(base: str) -> dict[str, Any]:
    """The server's :class:`bench.servers.producer.GcClock` reading."""
    with urllib.request.urlopen(f"{base}/_bench/gc", timeout=30) as answer:
        clock: dict[str, Any] = json.loads(answer.read())
    return clock


def profile(seconds: float) -> dict[str, Any]:
    """Every setup of :data:`SETUPS` on both frameworks, ``seconds`` of samples each."""
    out: dict[str, Any] = {}
    for framework in processes.FRAMEWORKS:
        for name, mode, path, variants in SETUPS:
            for variant in variants:
                out[f"{framework}/{name}/{variant}"] = record(
                    framework, variant, mode, path, seconds, name=name
                )
                print(f"  profile: {framework}/{name}/{variant} done", flush=True)
    return out


def _us(share: float, cost: float | None) -> str:
    return "-" if cost is None else f"{share * cost:.1f}"


def render(out: dict[str, Any], meta: dict[str, Any]) -> str:
    """The Markdown that goes between the README's profile markers."""
    lines = [
        "### Profiles at 64 clients (py-spy)",
        "",
        f"Recorded {meta['date']} (`{meta['command']}`), py-spy at {RATE} Hz for "
        f"{meta['window']:.0f} s per server during the load client's measured window, "
        f"idle samples left out; load average {meta['load']:.2f} at the end. "
        "*Own* time is charged to the innermost Python frame (a C call such as a "
        "socket send or `orjson.dumps` to the line that made it), *inclusive* to every "
        "frame on the stack; µs are the share times the server CPU per event (per request "
        "for JSON) that the client measured in the same window.",
        "",
    ]
    for framework in processes.FRAMEWORKS:
        for name, mode, _, variants in SETUPS:
            runs = {v: out[key] for v in variants if (key := f"{framework}/{name}/{v}") in out}
            if "tether" in runs:
                lines += [f"#### {framework}, {SETUP_TITLES[name]}", "", *_section(mode, runs)]
    return "\n".join(lines)


def _section(mode: str, runs: dict[str, dict[str, Any]]) -> list[str]:
    """One framework and mode: areas side by side, then tether's top functions."""
    unit = "µs/event" if mode == "stream" else "µs/request"
    label = {"handoff": "hand-off", "raw": "raw", "limit": "limit", "tether": "tether"}
    names = list(runs)
    costs = ", ".join(
        f"{label[v]} {_num(runs[v]['cost'])} {unit} ({runs[v]['samples']} samples)" for v in names
    )
    lines = [f"Server CPU in the profiled window: {costs}."]
    if all("gc" in runs[v] for v in names):  # (profiles recorded before it was timed: none)
        gcs = ", ".join(f"{label[v]} {_gc(runs[v])}" for v in names)
        lines += [
            f"Of it, the cyclic garbage collector (`gc.callbacks`; inside the areas below, "
            f"charged to whichever frame's allocation set it off): {gcs}."
        ]
    lines += [""]
    areas = sorted(
        {a for run in runs.values() for a in run["areas"]},
        key=lambda a: -runs["tether"]["areas"].get(a, 0.0),
    )
    rows = []
    for name in areas:
        shares = {v: runs[v]["areas"].get(name, 0.0) for v in names}
        rows.append(
            [name, *(f"{_us(shares[v], runs[v]['cost'])} ({shares[v]:.0%})" for v in names)]
        )
    lines += _table(["area", *(f"{label[v]} {unit} (share)" for v in names)], rows)
    lines += [
        f"tether's top functions by own time, {unit} (share), and the same in the others:",
        "",
    ]
    lines += _table(
        ["function", "area", *(label[v] for v in names)],
        [
            [f"`{f}`", a, *(_own(runs[v], f, a) for v in names)]
            for f, a, _ in runs["tether"]["own"][:TOP]
        ],
    )
    tether = runs["tether"]
    lines += ["tether's own layers by inclusive time:", ""]
    lines += _table(
        ["function", "area", unit, "share"],
        [[f"`{f}`", a, _us(s, tether["cost"]), f"{s:.1%}"] for f, a, s in tether["layers"]],
    )
    return lines


def _gc(run: dict[str, Any]) -> str:
    """``µs (share), N collections per generation`` of one profiled server."""
    gc = run["gc"]
    counts = "/".join(str(count) for count in gc["collections"])
    return f"{_us(gc['share'], run['cost'])} ({gc['share']:.0%}; {counts} collections)"


def _own(run: dict[str, Any], function: str, where: str) -> str:
    """``µs (share)`` of one function's own time in one profiled server; ``-`` if it
    is not among the server's :data:`KEPT` first (or not there at all)."""
    share = next((s for f, a, s in run["own"] if (f, a) == (function, where)), None)
    return "-" if share is None else f"{_us(share, run['cost'])} ({share:.1%})"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]
