"""tether against the hand-off users write by hand, for every producer shape.

``python -m bench.matrix`` (what ``make bench`` calls) runs issue 26's matrix: for
each framework (Starlette under uvicorn with httptools, aiohttp; both on uvloop),
each producer shape (:data:`~bench.servers.producer.SHAPES`: a task per request,
one engine step with ``deliver_many``, an engine thread with
``deliver_many_threadsafe``), each serializer (orjson, the stdlib's ``json``) and
each concurrency, the load client streams 64 events per request from the
hand-off server (:mod:`bench.servers.handoff`) and from the tether server, back
to back; JSON requests go against a hand-written future per request, and (for
scale, with no target) against the same future with the disconnect watch users
write by hand (:data:`WATCHED`). The
no-hand-off limit (pre-built events, no producer) is measured beside them, for
scale. A repetition starts the servers of a framework afresh with one hash seed,
and one client process runs all its windows (the pair of a cell seconds apart,
their order alternating from cell to cell and from repetition to repetition).
A ratio is the median of the per-repetition ratios.

The headline table goes between the ``matrix:begin``/``matrix:end`` markers of
``bench/README.md``, the absolute figures between ``matrix-detail:begin``/``end``
of ``bench/RESULTS.md``, the raw results to ``bench/results/matrix.json`` (which
:mod:`bench.charts` draws). ``--quick`` is a seconds-long smoke run of every cell
shape at one small concurrency that prints its tables and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from . import report
from .processes import FRAMEWORKS, ROOT, client_plan, server
from .servers.handoff import SERIALIZERS
from .servers.producer import SHAPES

__all__ = [
    "BEGIN",
    "DETAIL_BEGIN",
    "DETAIL_END",
    "END",
    "FULL",
    "QUICK",
    "SIDES",
    "TARGETS",
    "WATCHED",
    "WATCHED_LABEL",
    "Plan",
    "main",
    "render",
    "run",
]

BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
DETAIL_BEGIN, DETAIL_END = "<!-- matrix-detail:begin -->", "<!-- matrix-detail:end -->"
EVENTS = 64
TARGETS = {"events": 1.2, "cpu": 0.85, "json": 0.9}
"""Issue 26's: streaming events/s ≥ 1.2x the hand-off's and server CPU per event ≤
0.85x its, in every cell; JSON requests/s ≥ 0.9x the hand-written endpoint's."""
WATCHED_LABEL = "JSON body, against a hand-off that watches"
SHAPE_LABELS = {
    "task": "task per request",
    "step": "engine step (`deliver_many`)",
    "thread": "engine thread (`deliver_many_threadsafe`)",
}
JSON_SHAPE = "step"
"""The producer of the JSON runs: the engine step most servers have."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long and how wide the matrix runs."""

    reps: int
    concurrency: tuple[int, ...]
    duration: float
    warmup: float
    serializers: tuple[str, ...] = tuple(SERIALIZERS)
    shapes: tuple[str, ...] = SHAPES
    min_requests: int = 0
    frameworks: tuple[str, ...] = FRAMEWORKS
    json: bool = True
    """Whether the JSON cells run (``--shapes ''`` with it: the JSON rows alone)."""

    def warmup_for(self, concurrency: int) -> float:
        # 512 streams start in one wave: let it break up before measuring
        return self.warmup * 2 if concurrency >= 256 else self.warmup


FULL = Plan(reps=3, concurrency=(1, 64, 512), duration=1.5, warmup=0.5)
QUICK = Plan(reps=1, concurrency=(4,), duration=0.1, warmup=0.05, min_requests=1)

Runs = list[dict[str, Any]]


SIDES = ("handoff", "tether", "watched")
"""The sides of a JSON cell (a streaming cell has the first two)."""
WATCHED = {"starlette": "&watch=1", "aiohttp": ""}
"""The query of a JSON request to the hand-off that watches for disconnects: on
Starlette its ``/json?watch=1`` (a task reading ``receive`` beside the answer, as
vLLM does); on aiohttp a hand-off server run with ``handler_cancellation``."""


@contextlib.contextmanager
def _servers(framework: str, seed: int, json: bool) -> Iterator[dict[str, tuple[int, str]]]:
    """The hand-off, tether and limit servers of one repetition, on uvloop; with
    ``json``, the hand-off that watches for disconnects (``watched``) too."""
    with contextlib.ExitStack() as stack:
        servers = {
            variant: stack.enter_context(server(framework, variant, "--loop", "uvloop", seed=seed))
            for variant in ("handoff", "tether", "limit")
        }
        if json:
            servers["watched"] = (
                stack.enter_context(
                    server(
                        framework,
                        "handoff",
                        "--loop",
                        "uvloop",
                        "--handler-cancellation",
                        seed=seed,
                    )
                )
                if framework == "aiohttp"
                else servers["handoff"]
            )
        yield servers


def _cells(plan: Plan) -> list[tuple[str, str, str, int]]:
    """``(section, shape, serializer, concurrency)`` of every paired cell."""
    cells = [
        ("stream", shape, name, conc)
        for shape in plan.shapes
        for name in plan.serializers
        for conc in plan.concurrency
    ]
    if plan.json:
        cells += [("json", JSON_SHAPE, "orjson", conc) for conc in plan.concurrency]
    return cells


def run(plan: Plan) -> dict[str, Any]:
    """Every cell of ``plan``, ``plan.reps`` times; the raw results by cell key
    (``framework/shape/serializer/concurrency``) and side."""
    out: dict[str, Any] = {"stream": {}, "json": {}, "limit": {}}
    cells = _cells(plan)
    for rep in range(plan.reps):
        for framework in plan.frameworks:
            with _servers(framework, seed=rep + 1, json=plan.json) as servers:
                argvs: list[list[object]] = []
                where: list[tuple[str, str, str]] = []
                for index, (section, shape, name, conc) in enumerate(cells):
                    sides = list(SIDES if section == "json" else SIDES[:2])
                    turn = (rep + index) % len(sides)  # (the order rotates)
                    for side in sides[turn:] + sides[:turn]:
                        pid, base = servers[side]
                        path = f"/{section}?n={EVENTS}&shape={shape}&json={name}"
                        path += WATCHED[framework] if side == "watched" else ""
                        argvs.append(_argv(plan, section, base + path, conc, pid))
                        where.append((section, f"{framework}/{shape}/{name}/{conc}", side))
                for conc in plan.concurrency:
                    pid, base = servers["limit"]
                    argvs.append(_argv(plan, "stream", f"{base}/stream?n={EVENTS}", conc, pid))
                    where.append(("limit", f"{framework}/{conc}", "limit"))
                results = client_plan(argvs)
            for (section, key, side), result in zip(where, results, strict=True):
                out[section].setdefault(key, {}).setdefault(side, []).append(result)
            print(f"  matrix rep {rep + 1}: {framework} done", flush=True)
    return out


def _argv(plan: Plan, mode: str, url: str, conc: int, pid: int) -> list[object]:
    argv: list[object] = [mode, url, "--concurrency", conc, "--server-pid", pid]
    argv += ["--warmup", plan.warmup_for(conc), "--duration", plan.duration]
    argv += ["--min-requests", plan.min_requests]
    if mode == "stream":
        argv += ["--expect", EVENTS]
    return argv


def paired(sides: dict[str, Runs], field: str, base: str = "handoff") -> float | None:
    """The median over repetitions of tether's ``field`` over ``base``'s."""
    pairs = [
        ours[field] / theirs[field]
        for ours, theirs in zip(sides.get("tether", []), sides.get(base, []), strict=False)
        if ours.get(field) and theirs.get(field)
    ]
    return statistics.median(pairs) if pairs else None


def _median(runs: Runs, field: str) -> float | None:
    values = [run[field] for run in runs if run.get(field) is not None]
    return statistics.median(values) if values else None


def _mark(ratio: float | None, ok: bool | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" if ok else f"**{ratio:.2f}** ✗"


def _verdict(ratio: float | None, bound: float, *, at_most: bool = False) -> bool | None:
    if ratio is None:
        return None
    return ratio <= bound if at_most else ratio >= bound


def render(out: dict[str, Any]) -> tuple[str, str]:
    """The README's headline block and the detail block of RESULTS.md."""
    meta = out["meta"]
    concs = sorted({int(key.rsplit("/", 1)[1]) for key in (*out["stream"], *out["json"])})
    head = ["framework", "producer", "JSON", *(f"C = {c}" for c in concs)]
    rows: list[list[str]] = []
    met = total = 0
    bad = 0
    for framework in FRAMEWORKS:
        for shape in SHAPES:
            for name in SERIALIZERS:
                cells = []
                for conc in concs:
                    sides = out["stream"].get(f"{framework}/{shape}/{name}/{conc}")
                    if sides is None:
                        cells.append("-")
                        continue
                    bad += sum(r["bad_responses"] for runs in sides.values() for r in runs)
                    events = paired(sides, "events_per_s")
                    cpu = paired(sides, "server_cpu_us_per_event")
                    ok_events = _verdict(events, TARGETS["events"])
                    ok_cpu = _verdict(cpu, TARGETS["cpu"], at_most=True)
                    total += 2
                    met += bool(ok_events) + bool(ok_cpu)
                    cells.append(f"{_mark(events, ok_events)} / {_mark(cpu, ok_cpu)}")
                if any(cell != "-" for cell in cells):
                    rows.append([framework, SHAPE_LABELS[shape], name, *cells])
        cells = []
        for conc in concs:
            sides = out["json"].get(f"{framework}/{JSON_SHAPE}/orjson/{conc}")
            if sides is None:
                cells.append("-")
                continue
            bad += sum(r["bad_responses"] for runs in sides.values() for r in runs)
            requests = paired(sides, "requests_per_s")
            cpu = paired(sides, "server_cpu_us_per_request")
            ok = _verdict(requests, TARGETS["json"])
            total += 1
            met += bool(ok)
            cpu_text = "-" if cpu is None else f"{cpu:.2f}"
            cells.append(f"{_mark(requests, ok)} / {cpu_text}")
        if any(cell != "-" for cell in cells):
            rows.append([framework, "JSON body, engine step", "orjson", *cells])
        watched = []  # (for scale, no target: the hand-off with the watch users write)
        for conc in concs:
            sides = out["json"].get(f"{framework}/{JSON_SHAPE}/orjson/{conc}", {})
            requests = paired(sides, "requests_per_s", "watched")
            cpu = paired(sides, "server_cpu_us_per_request", "watched")
            watched.append("-" if requests is None else f"{_num(requests, 2)} / {_num(cpu, 2)}")
        if any(cell != "-" for cell in watched):
            rows.append([framework, WATCHED_LABEL, "orjson", *watched])
    lines = [
        f"Measured {meta['date']} by `{meta['command']}` in {meta['seconds']:.0f} s, "
        f"{meta['cpu']}, Python {meta['python']}, uvloop on both frameworks; load average "
        f"{meta['load_start']:.2f} at the start, {meta['load']:.2f} at the end (other jobs "
        "shared the machine: read the ratios, not the absolute figures). Each cell is "
        "tether over the hand-off, **events/s / server CPU per event** (JSON rows: "
        "requests/s / CPU per request), the median of "
        f"{meta['plan']['reps']} paired repetitions; ✗ marks a miss of issue 26's targets "
        f"(events/s ≥ {TARGETS['events']}x and CPU ≤ {TARGETS['cpu']}x; JSON requests/s ≥ "
        f"{TARGETS['json']}x). {met} of {total} targets met"
        + (f"; {bad} responses came back incomplete." if bad else ".")
        + " The last row of each framework, for scale and with no target: tether's JSON "
        "over a hand-written future that watches for disconnects as users do (Starlette: "
        "a task reading `receive` beside the answer, vLLM's way; aiohttp: its "
        "`handler_cancellation`)."
        + " Figures: [RESULTS.md](RESULTS.md#tether-against-the-hand-off).",
        "",
        *_table(head, rows),
    ]
    return "\n".join(lines), _detail(out, concs)


def _detail(out: dict[str, Any], concs: Sequence[int]) -> str:
    """Absolute medians of every cell, with the limit's beside them."""
    lines = [
        "## tether against the hand-off",
        "",
        "Medians of the repetitions of `python -m bench.matrix` (the run of the README's "
        "table): events/s hand-off / tether, and server CPU µs per event hand-off / "
        "tether; the no-hand-off limit (pre-built events, one write each, no producer) "
        "once per concurrency.",
        "",
    ]
    head = ["framework", "producer", "JSON", "clients", "events/s", "CPU µs/event", "ratios"]
    rows = []
    for framework in FRAMEWORKS:
        for conc in concs:
            limit = out["limit"].get(f"{framework}/{conc}", {}).get("limit", [])
            if limit:
                rows.append(
                    [
                        framework,
                        "limit (no hand-off)",
                        "orjson",
                        str(conc),
                        _num(_median(limit, "events_per_s")),
                        _num(_median(limit, "server_cpu_us_per_event"), 1),
                        "",
                    ]
                )
        for shape in SHAPES:
            for name in SERIALIZERS:
                for conc in concs:
                    sides = out["stream"].get(f"{framework}/{shape}/{name}/{conc}")
                    if sides is None:
                        continue
                    events, cpu = "events_per_s", "server_cpu_us_per_event"
                    rows.append(
                        [
                            framework,
                            shape,
                            name,
                            str(conc),
                            _pair(sides, events, 0),
                            _pair(sides, cpu, 1),
                            f"{_num(paired(sides, events), 2)} / {_num(paired(sides, cpu), 2)}",
                        ]
                    )
        for conc in concs:
            sides = out["json"].get(f"{framework}/{JSON_SHAPE}/orjson/{conc}")
            if sides is not None:
                rps, cpu = "requests_per_s", "server_cpu_us_per_request"
                rows.append(
                    [
                        framework,
                        "JSON (req/s, µs/request)",
                        "orjson",
                        str(conc),
                        _pair(sides, rps, 0),
                        _pair(sides, cpu, 1),
                        f"{_num(paired(sides, rps), 2)} / {_num(paired(sides, cpu), 2)}",
                    ]
                )
                if sides.get("watched"):
                    rows.append(
                        [
                            framework,
                            "JSON, the hand-off that watches / tether",
                            "orjson",
                            str(conc),
                            _pair(sides, rps, 0, "watched"),
                            _pair(sides, cpu, 1, "watched"),
                            f"{_num(paired(sides, rps, 'watched'), 2)} / "
                            f"{_num(paired(sides, cpu, 'watched'), 2)}",
                        ]
                    )
    return "\n".join([*lines, *_table(head, rows)])


def _pair(sides: dict[str, Runs], field: str, digits: int, base: str = "handoff") -> str:
    medians = (_median(sides.get(side, []), field) for side in (base, "tether"))
    return " / ".join(_num(value, digits) for value in medians)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _names(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="a short smoke run; writes nothing")
    parser.add_argument("--reps", type=int, help="repetitions (default: 3, quick: 1)")
    # A narrowed run (any of these) prints its tables and writes nothing: a part of the
    # matrix must not stand in the README for the whole.
    parser.add_argument("--frameworks", type=_names, help="e.g. starlette (default: both)")
    parser.add_argument("--shapes", type=_names, help="e.g. task,step; '' for none")
    parser.add_argument("--concurrency", type=_counts, help="e.g. 64,512")
    parser.add_argument("--no-json", action="store_true", help="leave the JSON cells out")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    narrowed = {
        name: value
        for name, value in (
            ("frameworks", args.frameworks),
            ("shapes", args.shapes),
            ("concurrency", args.concurrency),
            ("json", False if args.no_json else None),
        )
        if value is not None
    }
    plan = dataclasses.replace(plan, **narrowed)
    command = " ".join(["python -m bench.matrix", *(argv if argv is not None else sys.argv[1:])])
    started, load_start = time.time(), report.load_average()
    out = run(plan)
    out["meta"] = report.environment(
        plan=dataclasses.asdict(plan),
        command=command,
        seconds=time.time() - started,
        load_start=load_start,
    )
    headline, detail = render(out)
    if args.quick or narrowed:
        print(headline, detail, sep="\n\n", flush=True)
        return 0
    (ROOT / "bench" / "results" / "matrix.json").write_text(json.dumps(out, indent=1) + "\n")
    report.rewrite_readme(ROOT / "bench" / "README.md", headline, begin=BEGIN, end=END)
    report.rewrite_readme(report.RESULTS, detail, begin=DETAIL_BEGIN, end=DETAIL_END)
    print(f"matrix done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
