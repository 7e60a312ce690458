"""Turns the HTTP benchmark results into the tables of ``bench/README.md``.

Every figure is a median over the repetitions with its min-max; a ratio is the
median of the per-repetition ratios, with their range (the servers of one
repetition ran back to back with the same hash seed, so each pair saw the same
neighbours and the same dict layouts). Targets are checked here, and the misses listed.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .stats import percentile

__all__ = ["BEGIN", "END", "RESULTS", "environment", "load_average", "render", "rewrite_readme"]

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
"""The generated detail tables of every benchmark (the README keeps the headline)."""
BEGIN = "<!-- http:begin -->"
END = "<!-- http:end -->"
PACKAGES = ("tether", "starlette", "uvicorn", "httptools", "h11", "aiohttp", "uvloop", "orjson")

Runs = list[dict[str, Any]]


def load_average() -> float:
    """The machine's one-minute load average."""
    return os.getloadavg()[0]


def environment(**extra: Any) -> dict[str, Any]:
    """Versions and machine facts to print beside the numbers."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    cpu = "unknown"
    with open("/proc/cpuinfo") as file:
        for line in file:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "load": load_average(),
        "versions": versions,
        **extra,
    }


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _spread(values: Sequence[float | None], digits: int = 0) -> str:
    """``median (min-max)``."""
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    median = statistics.median(present)
    if len(present) == 1:
        return _num(median, digits)
    return f"{_num(median, digits)} ({_num(min(present), digits)}-{_num(max(present), digits)})"


def _median(runs: Runs, field: str) -> float | None:
    values = [run[field] for run in runs if run.get(field) is not None]
    return statistics.median(values) if values else None


def _ratio(ours: Runs, theirs: Runs, field: str) -> tuple[float | None, str]:
    """The median of the per-repetition ratios (tether over the baseline of the same
    repetition: same hash seed, same neighbours), and their range."""
    pairs = [
        a[field] / b[field]
        for a, b in zip(ours, theirs, strict=False)
        if a.get(field) and b.get(field)
    ]
    if not pairs:
        return None, "-"
    ratio = statistics.median(pairs)
    text = f"**{ratio:.2f}**"
    if len(pairs) > 1:
        text += f" ({min(pairs):.2f}-{max(pairs):.2f})"
    return ratio, text


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "**missed**"


class _Doc:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.misses: list[str] = []

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        self.lines.extend("| " + " | ".join(row) + " |" for row in rows)
        self.lines.append("")

    def check(self, ok: bool | None, what: str) -> str:
        if ok is False:
            self.misses.append(what)
        return _verdict(ok)


def _keys(section: dict[str, Runs]) -> list[tuple[str, int]]:
    seen = {(key.split("/")[0], int(key.split("/")[2])) for key in section}
    return sorted(seen, key=lambda k: (k[0] != "starlette", k[1]))


def _compare(
    doc: _Doc,
    section: dict[str, Runs],
    *,
    field: str,
    label: str,
    target: float,
    name: str,
    extra: Callable[[Runs, Runs], list[str]],
    extra_header: Sequence[str],
) -> None:
    """tether against the hand-written (``raw``) runs, with a target on the ratio."""
    rows = []
    for framework, conc in _keys(section):
        raw = section.get(f"{framework}/raw/{conc}", [])
        ours = section.get(f"{framework}/tether/{conc}", [])
        ratio, text = _ratio(ours, raw, field)
        ok = None if ratio is None else ratio >= target
        verdict = doc.check(ok, f"{name}, {framework}, {conc} clients: {text} (target ≥ {target})")
        row = [
            framework,
            str(conc),
            _spread([r.get(field) for r in raw]),
            _spread([r.get(field) for r in ours]),
            text,
            verdict,
        ]
        rows.append([*row, *extra(raw, ours)])
    header = ["framework", "clients", f"raw {label}", f"tether {label}", "ratio", f"≥ {target}x"]
    doc.table([*header, *extra_header], rows)


def _pair(raw: Runs, ours: Runs, field: str, digits: int = 0, *, ratio: bool = False) -> str:
    """``raw / tether`` medians, with tether's ratio when asked."""
    a, b = _median(raw, field), _median(ours, field)
    text = f"{_num(a, digits)} / {_num(b, digits)}"
    if ratio and a and b is not None:
        text += f" ({b / a:.2f}x)"
    return text


def _disconnect(doc: _Doc, section: dict[str, Runs]) -> None:
    rows = []
    for key, runs in section.items():
        label, mode = key.rsplit("/", 1)
        pooled = [ms for run in runs for ms in run["latencies_ms"]]
        p50, p99 = percentile(pooled, 50), percentile(pooled, 99)
        tries = sum(run["tries"] for run in runs)
        missed = sum(run["missed"] for run in runs)
        ok: bool | None = None
        target = "baseline"
        if "tether" in label and "handler_cancellation=False" in label:
            target = "p99 ≤ 100 ms"
            ok = p99 is not None and p99 <= 100 and not missed
        elif "tether" in label:
            target = "p50 ≤ 5 ms"
            ok = p50 is not None and p50 <= 5 and not missed
        what = f"disconnect, {label}, {mode}: p50 {_num(p50, 2)} ms, p99 {_num(p99, 2)} ms"
        rows.append(
            [
                label,
                "streaming" if mode == "stream" else "non-streaming",
                _num(p50, 2),
                _num(p99, 2),
                _spread([run["p50_ms"] for run in runs], 2),
                f"{missed}/{tries}",
                target,
                doc.check(ok, what + (f", {missed} never aborted" if missed else "")),
            ]
        )
    header = ["setup", "endpoint", "p50 ms", "p99 ms", "per-rep p50 ms", "missed", "target", ""]
    doc.table(header, rows)


def _memory(doc: _Doc, section: dict[str, Runs]) -> None:
    rows = []
    for framework in ("starlette", "aiohttp"):
        raw, ours = section.get(f"{framework}/raw", []), section.get(f"{framework}/tether", [])
        if not raw and not ours:
            continue
        ratio, text = _ratio(ours, raw, "bytes_per_stream")
        ok = None if ratio is None else ratio <= 1.25
        streams = raw[0]["streams"] if raw else ours[0]["streams"]
        rows.append(
            [
                framework,
                str(streams),
                _spread([r["bytes_per_stream"] / 1024 for r in raw], 1),
                _spread([r["bytes_per_stream"] / 1024 for r in ours], 1),
                text,
                doc.check(ok, f"memory, {framework}: {text} (target ≤ 1.25)"),
            ]
        )
    doc.table(
        ["framework", "open streams", "raw KiB/stream", "tether KiB/stream", "ratio", "≤ 1.25x"],
        rows,
    )


def render(out: dict[str, Any]) -> str:
    """The Markdown that goes between the README's markers."""
    meta = out["meta"]
    doc = _Doc()
    add = doc.lines.append
    add("## Batch, disconnect, memory (HTTP)")
    add("")
    add(
        f"Recorded {meta['date']} with `make bench` (`{meta['command']}`), in "
        f"{meta['seconds']:.0f} s, on {meta['cpu']}, Python {meta['python']}; "
        f"load average {meta['load']:.2f} at the end."
    )
    kept = {name: date for name, date in meta.get("sections", {}).items() if date != meta["date"]}
    if kept:
        add(
            "Not re-run by this run, kept as recorded: "
            + ", ".join(f"{name} ({date})" for name, date in sorted(kept.items()))
            + "."
        )
    add("Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".")
    profile = meta["profile"]
    add(
        f"Each figure is the median of {profile['reps']} repetitions (min-max in brackets); "
        f"throughput windows last {profile['duration']} s after a warm-up. **The ratios come "
        "from one run on a shared 2-core machine** (server and load client each take a core, "
        "other jobs may run beside them): read them, not the absolute numbers. The servers of "
        "a repetition share a hash seed, and every server runs with glibc's malloc thresholds "
        "pinned (`bench/processes.py` says why); a ratio is the median of the per-repetition "
        "ratios."
    )
    add("")
    if out["batch"]:
        add("### Batch streaming: 64 sub-requests x 64 outputs in one request")
        add("")
        add("Baseline (`raw`): a task per sub-request `__anext__`, re-armed after each output, ")
        add("multiplexed with `asyncio.wait(FIRST_COMPLETED)`; tether: `Registry.open_batch`.")
        add("")
        _compare(
            doc,
            out["batch"],
            field="events_per_s",
            label="outputs/s",
            target=3.0,
            name="batch",
            extra=lambda raw, ours: [_pair(raw, ours, "server_cpu_us_per_event", 1, ratio=True)],
            extra_header=["server CPU µs/output"],
        )
    if out["disconnect"]:
        add("### Disconnect to abort: client close → producer's `on_abort`")
        add("")
        add(
            f"{profile['tries']} tries per repetition, pooled; each closes at a random moment "
            "(streaming: after the first event; the polling baseline's non-streaming closes "
            "spread over its 4 s period). Both clocks are `time.monotonic()` (system-wide)."
        )
        add("")
        _disconnect(doc, out["disconnect"])
    if out["memory"]:
        add("### Memory: idle open streams")
        add("")
        add(
            "Server RSS growth (`VmRSS`) per stream held open after its first event, "
            "a fresh server each time."
        )
        add("")
        _memory(doc, out["memory"])
    add("### Targets")
    add("")
    add(
        "Batch ≥ 3x the hand-written interleave; disconnect and memory as in their "
        "tables. Streaming and JSON throughput: the matrix above."
    )
    add("")
    if doc.misses:
        add("Missed in this run:")
        add("")
        doc.lines.extend(f"- {miss}" for miss in doc.misses)
    else:
        add("Every target was met in this run.")
    add("")
    return "\n".join(doc.lines)


def rewrite_readme(path: Path, text: str, *, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between the markers (appending them if absent)."""
    block = f"{begin}\n{text}\n{end}"
    if not path.exists():
        path.write_text(f"# Benchmarks\n\n{block}\n")
        return
    current = path.read_text()
    start, stop = current.find(begin), current.find(end)
    if start < 0 or stop < start:
        path.write_text(current.rstrip("\n") + f"\n\n{block}\n")
        return
    path.write_text(current[:start] + block + current[stop + len(end) :])
