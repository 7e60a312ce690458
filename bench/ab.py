"""tether on one tree against tether on another: did a change make it slower?

``python -m bench.ab BASE [CANDIDATE]`` starts the tether benchmark server of each
tree side by side (the harness, its producers and its load client are this
checkout's, so the two sides run the same work), and measures both in every cell
(framework, producer shape, concurrency; streams, or ``--json`` requests), the two
windows of a cell seconds apart and their order alternating from cell to cell and
from repetition to repetition. A tree is a directory holding ``src/`` and
``adapters/``, or a git revision of this repository (exported to a temporary
directory); CANDIDATE defaults to this checkout.

What it prints is, per cell, the median of the per-repetition ratios CANDIDATE over
BASE of events/s (requests/s) and of server CPU per event (request), with their
spread: on a shared machine a single repetition says little, and the spread says
how little. ``--quick`` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from .processes import FRAMEWORKS, ROOT, client_plan, server
from .servers.producer import SHAPES

__all__ = ["Cell", "Plan", "main", "render", "run"]

EVENTS = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which cells, how often, how long."""

    frameworks: tuple[str, ...] = FRAMEWORKS
    shapes: tuple[str, ...] = SHAPES
    concurrency: tuple[int, ...] = (1, 64, 512)
    reps: int = 10
    duration: float = 1.0
    warmup: float = 0.3
    json: bool = False


QUICK = Plan(frameworks=("starlette",), shapes=("step",), concurrency=(4,), reps=2, duration=0.2)


@dataclasses.dataclass
class Cell:
    """One cell's per-repetition ratios, candidate over base."""

    rate: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def tree(spec: str) -> Iterator[Path]:
    """The source tree ``spec`` names: a directory as it is, or a git revision of
    this repository exported (``src/`` and ``adapters/``) for as long as it is used."""
    path = Path(spec)
    if (path / "src" / "tether").is_dir():
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="tether-ab-") as into:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", spec, "src", "adapters"],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise SystemExit(
                f"{spec!r} is neither a source tree nor a revision: {archive.stderr!r}"
            )
        with tempfile.TemporaryFile() as file:
            file.write(archive.stdout)
            file.seek(0)
            with tarfile.open(fileobj=file) as tar:
                tar.extractall(into, filter="data")
        yield Path(into)


def _server_of(
    source: Path, framework: str, seed: int
) -> contextlib.AbstractContextManager[tuple[int, str]]:
    """The tether server of ``framework``, importing tether from ``source``."""
    path = os.pathsep.join([str(source / "src"), str(source / "adapters"), str(ROOT)])
    return server(framework, "tether", "--loop", "uvloop", seed=seed, env={"PYTHONPATH": path})


def run(plan: Plan, base: Path, candidate: Path) -> dict[str, Cell]:
    """Every cell of ``plan``, ``plan.reps`` times; its ratios by cell key
    (``framework/shape/concurrency``)."""
    mode = "json" if plan.json else "stream"
    rate, cpu = (
        ("requests_per_s", "server_cpu_us_per_request")
        if plan.json
        else (
            "events_per_s",
            "server_cpu_us_per_event",
        )
    )
    cells: dict[str, Cell] = {}
    for rep in range(plan.reps):
        for framework in plan.frameworks:
            with contextlib.ExitStack() as stack:
                sides = {
                    name: stack.enter_context(_server_of(source, framework, seed=rep + 1))
                    for name, source in (("base", base), ("candidate", candidate))
                }
                argvs: list[list[object]] = []
                where: list[tuple[str, str]] = []
                keys = [(s, c) for s in plan.shapes for c in plan.concurrency]
                for index, (shape, conc) in enumerate(keys):
                    order = ["base", "candidate"]
                    if (rep + index) % 2:
                        order.reverse()
                    for side in order:
                        pid, url = sides[side]
                        argv: list[object] = [
                            mode,
                            f"{url}/{mode}?n={EVENTS}&shape={shape}&json=orjson",
                        ]
                        argv += ["--concurrency", conc, "--server-pid", pid]
                        argv += ["--warmup", plan.warmup * (2 if conc >= 256 else 1)]
                        argv += ["--duration", plan.duration, "--min-requests", 1]
                        if mode == "stream":
                            argv += ["--expect", EVENTS]
                        argvs.append(argv)
                        where.append((f"{framework}/{shape}/{conc}", side))
                results = client_plan(argvs)
            got = dict(zip(where, results, strict=True))
            for shape, conc in keys:
                key = f"{framework}/{shape}/{conc}"
                ours, theirs = got[(key, "candidate")], got[(key, "base")]
                cell = cells.setdefault(key, Cell())
                if ours.get(rate) and theirs.get(rate):
                    cell.rate.append(ours[rate] / theirs[rate])
                if ours.get(cpu) and theirs.get(cpu):
                    cell.cpu.append(ours[cpu] / theirs[cpu])
        print(f"  ab rep {rep + 1} of {plan.reps} done", file=sys.stderr, flush=True)
    return cells


def _summary(ratios: Sequence[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def render(cells: dict[str, Cell], *, json: bool = False) -> str:
    """The cells as a table: medians of candidate over base, with their spread."""
    what = "requests/s" if json else "events/s"
    lines = [
        f"| framework | producer | C | {what}, candidate / base | server CPU per "
        f"{'request' if json else 'event'}, candidate / base | reps |",
        "|---|---|---|---|---|---|",
    ]
    for key, cell in cells.items():
        framework, shape, conc = key.split("/")
        lines.append(
            f"| {framework} | {shape} | {conc} | {_summary(cell.rate)} | {_summary(cell.cpu)} "
            f"| {len(cell.rate)} |"
        )
    return "\n".join(lines)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _names(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("base", help="a source tree or a git revision")
    parser.add_argument("candidate", nargs="?", default=str(ROOT), help="default: this checkout")
    parser.add_argument("--frameworks", type=_names, default=Plan.frameworks)
    parser.add_argument("--shapes", type=_names, default=Plan.shapes)
    parser.add_argument("--concurrency", type=_counts, default=Plan.concurrency)
    parser.add_argument("--reps", type=int, default=Plan.reps)
    parser.add_argument("--duration", type=float, default=Plan.duration)
    parser.add_argument("--json", action="store_true", help="JSON requests instead of streams")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        plan = dataclasses.replace(QUICK, json=args.json)
    else:
        plan = Plan(
            frameworks=args.frameworks,
            shapes=args.shapes,
            concurrency=args.concurrency,
            reps=args.reps,
            duration=args.duration,
            json=args.json,
        )
    with tree(args.base) as base, tree(args.candidate) as candidate:
        cells = run(plan, base, candidate)
    print(render(cells, json=plan.json), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
