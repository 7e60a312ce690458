"""The charts of ``bench/README.md``, drawn as SVG from the kept results.

``python -m bench.charts`` (the last step of ``make bench``) reads
``bench/results/matrix.json`` and ``bench/results/core.json`` and writes grouped bar
charts into ``bench/charts/``: streaming events/s and server CPU per event of
tether, the hand-off and the no-hand-off limit at each concurrency, JSON requests
per second, and the core's outputs/s against its hand-written tables. SVG is
written by hand (a few rectangles and labels), so the benchmark needs no plotting
library; a chart whose results are missing is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["CHARTS", "Bar", "Panel", "bar_chart", "main", "nice_ticks"]

HERE = Path(__file__).resolve().parent
CHARTS = HERE / "charts"
RESULTS = HERE / "results"

Bar = tuple[str, float | None]
"""``(series, value)``; ``None`` draws nothing."""
Panel = tuple[str, list[tuple[str, list[Bar]]]]
"""``(title, [(group label, bars), ...])``."""

PALETTE = {
    "limit": "#9e9e9e",
    "hand-off, task": "#f4a582",
    "tether, task": "#b2182b",
    "hand-off, step": "#92c5de",
    "tether, step": "#2166ac",
    "hand-off, thread": "#c2a5cf",
    "tether, thread": "#762a83",
    "hand-off": "#92c5de",
    "tether": "#2166ac",
    "a: event + wait_for": "#fdb863",
    "b: merging slot": "#b2abd2",
    "c: queue": "#a6dba0",
}
SHAPES = ("task", "step", "thread")
FRAMEWORKS = ("starlette", "aiohttp")


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [step * i for i in range(math.ceil(top / step) + 1)]


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def bar_chart(title: str, unit: str, panels: Sequence[Panel], note: str = "") -> str:
    """Panels side by side, each a group of bars per label, sharing one y scale."""
    series = list(
        dict.fromkeys(name for _, groups in panels for _, bars in groups for name, _ in bars)
    )
    values = [v for _, groups in panels for _, bars in groups for _, v in bars if v is not None]
    ticks = nice_ticks(max(values, default=1.0))
    top = ticks[-1]
    bar_w, gap, pad = 11, 18, 56
    group_w = (
        max((len(bars) for _, groups in panels for _, bars in groups), default=1) * bar_w + gap
    )
    panel_w = max((len(groups) for _, groups in panels), default=1) * group_w + 24
    width = max(560, pad + len(panels) * (panel_w + 20) + 10)
    columns = max(1, (width - pad) // 165)
    legend_rows = math.ceil(len(series) / columns)
    plot_top, plot_h = 52 + 18 * legend_rows, 220
    height = plot_top + plot_h + 64
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{pad}" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for index, name in enumerate(series):
        x, y = pad + (index % columns) * 165, 38 + 18 * (index // columns)
        out.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{_color(name)}"/>')
        out.append(f'<text x="{x + 14}" y="{y}">{escape(name)}</text>')
    for p, (panel_title, groups) in enumerate(panels):
        left = pad + p * (panel_w + 20)
        bottom = plot_top + plot_h
        for tick in ticks:
            y = bottom - tick / top * plot_h
            out.append(
                f'<line x1="{left}" x2="{left + panel_w}" y1="{y:.1f}" y2="{y:.1f}" '
                'stroke="#e0e0e0"/>'
            )
            if p == 0:
                out.append(
                    f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_label(tick)}</text>'
                )
        out.append(
            f'<line x1="{left}" x2="{left + panel_w}" y1="{bottom}" y2="{bottom}" stroke="#444"/>'
        )
        out.append(
            f'<text x="{left + panel_w / 2}" y="{plot_top - 6}" text-anchor="middle" '
            f'font-weight="bold">{escape(panel_title)}</text>'
        )
        for g, (label, bars) in enumerate(groups):
            x0 = left + 12 + g * group_w
            for b, (name, value) in enumerate(bars):
                if value is None:
                    continue
                h = value / top * plot_h
                x = x0 + b * bar_w
                out.append(
                    f'<rect x="{x}" y="{bottom - h:.1f}" width="{bar_w - 1}" height="{h:.1f}" '
                    f'fill="{_color(name)}"><title>{escape(name)}, {escape(label)}: '
                    f"{value:,.1f} {escape(unit)}</title></rect>"
                )
            middle = x0 + len(bars) * bar_w / 2
            out.append(
                f'<text x="{middle:.1f}" y="{bottom + 15}" text-anchor="middle">'
                f"{escape(label)}</text>"
            )
    middle_y = plot_top + plot_h / 2
    out.append(
        f'<text x="14" y="{middle_y}" transform="rotate(-90 14 {middle_y})" '
        f'text-anchor="middle">{escape(unit)}</text>'
    )
    if note:
        out.append(f'<text x="{pad}" y="{height - 12}" fill="#555">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _color(name: str) -> str:
    return PALETTE.get(name, "#666666")


def _median(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [run[field] for run in runs if run.get(field) is not None]
    return statistics.median(values) if values else None


def streaming_panels(out: dict[str, Any], field: str) -> list[Panel]:
    """One panel per framework; per concurrency, the limit then each shape's
    hand-off and tether (orjson)."""
    concs = sorted({int(key.rsplit("/", 1)[1]) for key in out["stream"]})
    panels: list[Panel] = []
    for framework in FRAMEWORKS:
        groups = []
        for conc in concs:
            limit = out["limit"].get(f"{framework}/{conc}", {}).get("limit", [])
            bars: list[Bar] = [("limit", _median(limit, field))]
            for shape in SHAPES:
                sides = out["stream"].get(f"{framework}/{shape}/orjson/{conc}", {})
                bars.append((f"hand-off, {shape}", _median(sides.get("handoff", []), field)))
                bars.append((f"tether, {shape}", _median(sides.get("tether", []), field)))
            groups.append((f"C = {conc}", bars))
        panels.append((framework, groups))
    return panels


def json_panels(out: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    for framework in FRAMEWORKS:
        groups = []
        for key, sides in sorted(out["json"].items(), key=lambda kv: int(kv[0].rsplit("/", 1)[1])):
            if not key.startswith(f"{framework}/"):
                continue
            bars: list[Bar] = [
                ("hand-off", _median(sides.get("handoff", []), "requests_per_s")),
                ("tether", _median(sides.get("tether", []), "requests_per_s")),
            ]
            if sides.get("watched"):  # (results from before it was measured have none)
                bars.append(("hand-off that watches", _median(sides["watched"], "requests_per_s")))
            groups.append((f"C = {key.rsplit('/', 1)[1]}", bars))
        panels.append((framework, groups))
    return panels


CORE_SERIES = {
    "tether": "tether",
    "a:event+wait_for": "a: event + wait_for",
    "b:merging-slot": "b: merging slot",
    "c:queue": "c: queue",
    "d:floor": "d: floor (no guarantees)",
}


def core_panels(core: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    for loop, sizes in core["loops"].items():
        groups = [
            (f"N = {int(n):,}", [(CORE_SERIES.get(k, k), v) for k, v in medians.items()])
            for n, medians in sizes.items()
        ]
        panels.append((f"{loop} loop", groups))
    return panels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the results are")
    parser.add_argument("--into", type=Path, default=CHARTS, help="where the charts go")
    args = parser.parse_args(argv)
    charts_dir: Path = args.into
    charts_dir.mkdir(exist_ok=True)
    written = []
    matrix_file, core_file = args.results / "matrix.json", args.results / "core.json"
    if matrix_file.exists():
        out = json.loads(matrix_file.read_text())
        meta = out["meta"]
        note = f"{meta['date']}, load average {meta['load']:.1f}; orjson; medians of repetitions"
        charts = {
            "streaming-events.svg": bar_chart(
                "Streaming: events per second (64 events per request)",
                "events/s",
                streaming_panels(out, "events_per_s"),
                note,
            ),
            "streaming-cpu.svg": bar_chart(
                "Streaming: server CPU per event (lower is better)",
                "µs/event",
                streaming_panels(out, "server_cpu_us_per_event"),
                note,
            ),
            "json.svg": bar_chart(
                "JSON: requests per second (64 outputs, the last answered)",
                "requests/s",
                json_panels(out),
                note,
            ),
        }
        for name, svg in charts.items():
            (charts_dir / name).write_text(svg)
            written.append(name)
    else:
        print(f"{matrix_file} missing: run python -m bench.matrix first", file=sys.stderr)
    if core_file.exists():
        core = json.loads(core_file.read_text())
        note = f"{core['meta']['date']}, load average {core['meta']['load']:.1f}; medians"
        svg = bar_chart("Core: outputs per second", "outputs/s", core_panels(core), note)
        (charts_dir / "core.svg").write_text(svg)
        written.append("core.svg")
    else:
        print(f"{core_file} missing: run python -m bench.core --write first", file=sys.stderr)
    print("bench/charts/: " + (", ".join(written) or "nothing written"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
