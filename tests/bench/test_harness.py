"""Keeps the HTTP benchmark harness from rotting: short load runs against the
baseline servers, the limit servers' bytes against the hand-off's, the report's
target checks, the profile's arithmetic, and the README rewrite that must leave
other sections alone. No benchmark numbers are checked here, only that the
harness measures something sane."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import json_path, processes, profiling, report, stream_path


@pytest.mark.parametrize("variant", ["raw", "limit"], ids=["hand-off", "no-hand-off-limit"])
def test_load_client_streams_every_event_from_a_baseline_server(variant: str) -> None:
    with processes.server("aiohttp", variant) as (pid, base):
        result = processes.client(
            "stream",
            f"{base}/stream?n=64",
            *("--concurrency", 4, "--warmup", 0.2, "--duration", 0.6),
            *("--expect", 64, "--server-pid", pid),
        )
    assert result["requests"] > 0
    assert result["bad_responses"] == 0
    assert result["events_per_s"] >= 64 * result["requests"] / 0.6 * 0.5
    assert result["ttfe_p50_ms"] is not None
    assert result["ttfe_p50_ms"] <= result["ttfe_p99_ms"]
    assert result["server_cpu_us_per_event"] is not None


@pytest.mark.parametrize("framework", processes.FRAMEWORKS)
def test_limit_server_sends_byte_for_byte_what_the_hand_off_server_sends(framework: str) -> None:
    bodies: dict[str, list[bytes]] = {}
    for variant in ("raw", "limit"):
        with processes.server(framework, variant) as (_, base), httpx.Client(timeout=10) as http:
            answers = [http.get(f"{base}{path}") for path in ("/stream?n=5", "/json?n=5")]
        assert [answer.status_code for answer in answers] == [200, 200]
        bodies[variant] = [answer.content for answer in answers]
    assert bodies["limit"] == bodies["raw"]
    assert bodies["limit"][0].count(b"data: {") == 5


def _runs(**fields: float) -> list[dict[str, Any]]:
    return [{"requests_per_s": 1.0, "ttfe_p50_ms": 1.0, "ttfe_p99_ms": 2.0, **fields}]


def _rendered(stream: dict[str, list[dict[str, Any]]]) -> tuple[str, list[str]]:
    out: dict[str, Any] = {
        "stream": stream,
        "json": {},
        "batch": {},
        "disconnect": {},
        "memory": {},
        "meta": {
            "date": "today",
            "command": "python -m bench.run",
            "seconds": 1.0,
            "cpu": "cpu",
            "python": "3.11",
            "load": 0.0,
            "versions": {},
            "profile": {"reps": 1, "duration": 1.0, "tries": 1},
        },
    }
    text = report.render(out)
    misses = [line for line in text.splitlines() if line.startswith("- streaming")]
    return text, misses


def test_streaming_report_holds_tether_to_the_hand_off_and_to_the_limit() -> None:
    text, misses = _rendered(
        {
            "starlette/raw/64": _runs(events_per_s=100.0, server_cpu_us_per_event=10.0),
            "starlette/limit/64": _runs(events_per_s=200.0, server_cpu_us_per_event=5.0),
            "starlette/tether/64": _runs(events_per_s=150.0, server_cpu_us_per_event=8.0),
        }
    )
    row = next(line for line in text.splitlines() if line.startswith("| starlette | 64 | 100"))
    assert "| **1.50** | met | **0.75** | **missed** | 10.0 / 5.0 / 8.0 | **1.60** |" in row
    assert misses == [
        "- streaming / limit, starlette, 64 clients: **0.75** (target ≥ 0.8)",
        "- streaming CPU/event / limit's, starlette, 64 clients: **1.60** (target ≤ 1.25)",
    ]


def test_streaming_report_meets_targets_at_their_bounds() -> None:
    _, misses = _rendered(
        {
            "aiohttp/raw/1": _runs(events_per_s=100.0, server_cpu_us_per_event=4.0),
            "aiohttp/limit/1": _runs(events_per_s=125.0, server_cpu_us_per_event=4.0),
            "aiohttp/tether/1": _runs(events_per_s=100.0, server_cpu_us_per_event=5.0),
        }
    )
    assert misses == []


def test_profile_charges_own_time_to_the_innermost_frame_and_layers_once_per_sample() -> None:
    core, asyncio_dir = "/lib/tether/", "/lib/asyncio/"
    prefixes = [(core, "tether core"), (asyncio_dir, "asyncio")]
    raw = [
        # a recursive tether frame: inclusive time counts it once per sample
        f"run ({asyncio_dir}base_events.py);next ({core}_x.py);next ({core}_x.py) 3",
        f"run ({asyncio_dir}base_events.py);next ({core}_x.py);write ({asyncio_dir}t.py) 1",
        "select (/usr/lib/python3.11/selectors.py) 4",
        "",
    ]
    summary = profiling.summarise(profiling.parse(raw), 10.0, prefixes)
    assert summary.samples == 8
    assert summary.areas == {
        "tether core": 3 / 8,
        "other (stdlib, GC, ...)": 4 / 8,
        "asyncio": 1 / 8,
    }
    assert summary.own[0] == ("select", "other (stdlib, GC, ...)", 0.5)
    assert ("next", "tether core", 3 / 8) in summary.own
    assert summary.layers == [("next", "tether core", 4 / 8)]


def test_profile_tables_put_tethers_top_functions_beside_the_same_in_the_baselines() -> None:
    def run(cost: float, own: list[tuple[str, str, float]]) -> dict[str, Any]:
        areas = {"asyncio": sum(share for _, where, share in own if where == "asyncio")}
        areas["tether core"] = 1.0 - areas["asyncio"]
        return {"cost": cost, "samples": 100, "areas": areas, "own": own, "layers": []}

    write = ("write", "asyncio")
    runs = {
        "starlette/stream/tether": run(10.0, [(*write, 0.5), ("wait", "tether core", 0.5)]),
        "starlette/stream/raw": run(8.0, [(*write, 1.0)]),
        "starlette/stream/limit": run(4.0, [(*write, 1.0)]),
    }
    meta = {"date": "today", "command": "c", "window": 5.0, "load": 0.0}
    lines = profiling.render(runs, meta).splitlines()
    assert "| `write` | asyncio | 5.0 (50.0%) | 8.0 (100.0%) | 4.0 (100.0%) |" in lines
    assert "| `wait` | tether core | 5.0 (50.0%) | - | - |" in lines
    assert "| tether core | 5.0 (50%) | 0.0 (0%) | 0.0 (0%) |" in lines
    assert not any(line.startswith("#### aiohttp") for line in lines)


@pytest.mark.skipif(profiling.py_spy() is None, reason="py-spy is installed by `make bench` only")
def test_profile_of_a_running_server_accounts_for_its_samples(tmp_path: Path) -> None:
    result = profiling.record("aiohttp", "limit", "stream", "/stream?n=64", 1.0, into=tmp_path)
    assert (tmp_path / result["stacks"]).stat().st_size > 0
    assert result["samples"] > 0
    assert result["load"]["bad_responses"] == 0
    assert sum(result["areas"].values()) == pytest.approx(1.0)
    assert "aiohttp" in result["areas"]


def test_readme_rewrite_replaces_only_the_http_section(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    core = "<!-- core:begin -->\ncore table\n<!-- core:end -->"
    readme.write_text(f"# Benchmarks\n\n{core}\n\n{report.BEGIN}\nold\n{report.END}\n\nnotes\n")
    report.rewrite_readme(readme, "new tables")
    text = readme.read_text()
    assert core in text
    assert f"{report.BEGIN}\nnew tables\n{report.END}" in text
    assert "old" not in text
    assert text.endswith("notes\n")


def test_readme_rewrite_of_the_profile_leaves_the_http_section_alone(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    http = f"{report.BEGIN}\nhttp tables\n{report.END}"
    readme.write_text(f"# B\n\n{http}\n\n{profiling.BEGIN}\nold\n{profiling.END}\n")
    report.rewrite_readme(readme, "profiles", begin=profiling.BEGIN, end=profiling.END)
    assert readme.read_text() == f"# B\n\n{http}\n\n{profiling.BEGIN}\nprofiles\n{profiling.END}\n"


def test_readme_rewrite_appends_the_section_when_markers_are_missing(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\ncore section\n")
    report.rewrite_readme(readme, "tables")
    assert (
        readme.read_text()
        == f"# Benchmarks\n\ncore section\n\n{report.BEGIN}\ntables\n{report.END}\n"
    )


@pytest.mark.parametrize(
    ("path", "variant"),
    [
        (json_path, "raw"),
        (json_path, "manual"),
        (json_path, "tether"),
        (stream_path, "raw"),
        (stream_path, "tether"),
    ],
    ids=["json-raw", "json-manual", "json-tether", "stream-raw", "stream-tether"],
)
async def test_the_in_process_paths_answer_every_request_whole(path: Any, variant: str) -> None:
    app, producer = path.build(variant)
    sent: list[dict[str, Any]] = []
    task = asyncio.create_task(producer.run())
    try:
        async with asyncio.timeout(10):
            await json_path.one_request(app, sent)
            assert await path.measure(variant, 20) > 0
    finally:
        task.cancel()
        await asyncio.wait([task])
    assert sent[0]["status"] == 200
    assert sent[-1].get("more_body", False) is False
    body = b"".join(message.get("body", b"") for message in sent[1:])
    if path is json_path:  # the last output, as JSON
        assert json.loads(body) == {"n": json_path.OUTPUTS - 1, "delta": "lorem"}
    else:  # every output as an SSE event, then the terminal one
        assert body.count(b"data: {") == json_path.OUTPUTS
        assert body.endswith(b"data: [DONE]\n\n")
