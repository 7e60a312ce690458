"""Keeps the HTTP benchmark harness from rotting: short load runs against the
baseline servers, every server's bytes against the others' for each producer shape
and serializer, a quick run of the whole matrix, the report's target checks, the
profile's arithmetic, the charts, and the README rewrite that must leave other
sections alone. No benchmark numbers are checked here, only that the harness
measures something sane."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import (
    ab,
    aiohttp_path,
    charts,
    core,
    instructions,
    json_path,
    matrix,
    processes,
    profiling,
    report,
    run,
    stream_path,
)
from bench.servers.handoff import SERIALIZERS
from bench.servers.producer import SHAPES, GcClock


@pytest.mark.parametrize("workload", ["without", "with"])
def test_every_core_implementation_reads_every_output_of_the_workload(workload: str) -> None:
    """tether and each hand-written table, the floor included, on both workloads:
    every output reaches its reader (the run raises on a lost one)."""
    implementations = core.MERGED if workload == "with" else core.IMPLEMENTATIONS
    assert "d:floor" in implementations
    for name, runner in implementations.items():
        assert core.measure(runner, 50) > 0, name


@pytest.mark.parametrize("variant", ["raw", "limit"])
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
def test_every_server_sends_the_same_bytes_for_each_producer_shape_and_serializer(
    framework: str,
) -> None:
    bodies: dict[tuple[str, str, str], list[bytes]] = {}
    for variant in ("handoff", "tether", "raw", "limit"):
        configurable = variant in ("handoff", "tether")
        queries = [
            (shape, name)
            for shape in (SHAPES if configurable else ("step",))
            for name in (SERIALIZERS if configurable else ("orjson",))
        ]
        with (
            processes.server(framework, variant, "--loop", "uvloop") as (_, base),
            httpx.Client(timeout=10) as http,
        ):
            for shape, name in queries:
                query = f"n=5&shape={shape}&json={name}"
                answers = [http.get(f"{base}/{path}?{query}") for path in ("stream", "json")]
                assert [answer.status_code for answer in answers] == [200, 200]
                bodies[(variant, shape, name)] = [answer.content for answer in answers]
                if variant == "handoff":  # the hand-off that watches answers alike
                    watched = http.get(f"{base}/json?{query}{matrix.WATCHED[framework]}")
                    assert (watched.status_code, watched.content) == (200, answers[1].content)
    for (_, shape, name), body in bodies.items():
        assert body == bodies[("handoff", "step", name)], (shape, name)
    stdlib, fast = bodies[("tether", "task", "stdlib")], bodies[("tether", "task", "orjson")]
    assert stdlib != fast  # the serializer really is the one asked for
    assert fast[0].count(b"data: {") == 5
    assert fast[0].endswith(b"data: [DONE]\n\n")


def test_quick_matrix_measures_both_sides_of_every_cell() -> None:
    out = matrix.run(matrix.QUICK)
    concurrency = matrix.QUICK.concurrency
    assert set(out["stream"]) == {
        f"{framework}/{shape}/{name}/{conc}"
        for framework in processes.FRAMEWORKS
        for shape in SHAPES
        for name in SERIALIZERS
        for conc in concurrency
    }
    assert set(out["json"]) == {
        f"{framework}/step/orjson/{conc}"
        for framework in processes.FRAMEWORKS
        for conc in concurrency
    }
    for section, expected in (("stream", {"handoff", "tether"}), ("json", set(matrix.SIDES))):
        for sides in out[section].values():
            assert set(sides) == expected
            for runs in sides.values():
                (result,) = runs
                assert result["requests"] > 0
                assert result["bad_responses"] == 0
                assert result["server_cpu_share"] > 0
    assert all(runs["limit"][0]["requests"] > 0 for runs in out["limit"].values())


def _matrix_out(stream: dict[str, Any], json_cells: dict[str, Any]) -> dict[str, Any]:
    meta = {
        "date": "today",
        "command": "python -m bench.matrix",
        "seconds": 1.0,
        "cpu": "cpu",
        "python": "3.11",
        "load": 0.0,
        "load_start": 0.0,
        "versions": {},
        "plan": {"reps": 2},
    }
    return {"stream": stream, "json": json_cells, "limit": {}, "meta": meta}


def _sides(rate: str, cpu: str, pairs: list[tuple[float, float, float, float]]) -> Any:
    """Repetitions of ``(hand-off rate, hand-off CPU, tether rate, tether CPU)``."""
    return {
        "handoff": [{rate: a, cpu: b, "bad_responses": 0} for a, b, _, _ in pairs],
        "tether": [{rate: c, cpu: d, "bad_responses": 0} for _, _, c, d in pairs],
    }


def test_ab_runs_two_trees_under_one_harness_and_pairs_every_repetition() -> None:
    with ab.tree("HEAD") as exported:  # a revision, exported: what a regression check compares
        assert (exported / "src" / "tether" / "__init__.py").is_file()
        assert (exported / "adapters" / "tether_starlette" / "__init__.py").is_file()
        cells = ab.run(ab.QUICK, processes.ROOT, exported)
    (key,) = cells
    assert key == "starlette/step/4"
    assert len(cells[key].rate) == len(cells[key].cpu) == ab.QUICK.reps
    assert all(ratio > 0 for ratio in cells[key].rate + cells[key].cpu)
    assert "| starlette | step | 4 | " in ab.render(cells)


def test_matrix_headline_pairs_repetitions_and_marks_each_missed_target() -> None:
    rate, cpu = "events_per_s", "server_cpu_us_per_event"
    stream = {
        # pairs 1.2x / 0.85x and 1.4x / 0.5x: medians 1.3x and 0.675x, both met
        "aiohttp/step/orjson/64": _sides(rate, cpu, [(100, 10, 120, 8.5), (100, 10, 140, 5)]),
        # events/s 1.1x and CPU 0.9x: both missed
        "aiohttp/task/orjson/64": _sides(rate, cpu, [(100, 10, 110, 9), (200, 10, 220, 9)]),
    }
    json_cells = {
        "aiohttp/step/orjson/64": _sides(
            "requests_per_s", "server_cpu_us_per_request", [(100, 50, 90, 60), (100, 50, 80, 60)]
        )
    }
    headline, detail = matrix.render(_matrix_out(stream, json_cells))
    lines = headline.splitlines()
    assert "| aiohttp | engine step (`deliver_many`) | orjson | 1.30 / 0.68 |" in lines
    assert "| aiohttp | task per request | orjson | **1.10** ✗ / **0.90** ✗ |" in lines
    assert "| aiohttp | JSON body, engine step | orjson | **0.85** ✗ / 1.20 |" in lines
    assert "2 of 5 targets met." in headline
    # the hand-off that watches is a row for scale, with no target (no ✗, not counted)
    json_cells["aiohttp/step/orjson/64"]["watched"] = [
        {"requests_per_s": 50, "server_cpu_us_per_request": 80, "bad_responses": 0}
    ] * 2
    headline, detail = matrix.render(_matrix_out(stream, json_cells))
    assert f"| aiohttp | {matrix.WATCHED_LABEL} | orjson | 1.70 / 0.75 |" in headline.splitlines()
    assert "2 of 5 targets met." in headline
    assert (
        "| aiohttp | JSON, the hand-off that watches / tether | orjson | 64 | 50 / 85 "
        "| 80.0 / 60.0 | 1.70 / 0.75 |" in detail.splitlines()
    )
    assert (
        "| aiohttp | step | orjson | 64 | 100 / 130 | 10.0 / 6.8 | 1.30 / 0.68 |"
        in detail.splitlines()
    )


def test_charts_draw_a_bar_per_side_and_concurrency_from_the_kept_results(tmp_path: Path) -> None:
    rate, cpu = "events_per_s", "server_cpu_us_per_event"
    stream = {
        f"starlette/{shape}/orjson/{conc}": _sides(rate, cpu, [(100, 10, 130, 8)])
        for shape in SHAPES
        for conc in (1, 64)
    }
    out = _matrix_out(stream, {})
    out["limit"] = {"starlette/1": {"limit": [{rate: 200.0, cpu: 5.0}]}}
    (tmp_path / "matrix.json").write_text(json.dumps(out))
    into = tmp_path / "charts"
    assert charts.main(["--results", str(tmp_path), "--into", str(into)]) == 0
    svg = (into / "streaming-events.svg").read_text()
    assert svg.startswith("<svg")
    assert svg.rstrip().endswith("</svg>")
    # 3 shapes x 2 sides x 2 concurrencies, and the limit at C = 1 only
    assert svg.count("<title>") == 13
    assert "<title>tether, thread, C = 64: 130.0 events/s</title>" in svg
    assert "<title>limit, C = 1: 200.0 events/s</title>" in svg
    assert not (into / "core.svg").exists()  # no core results: skipped, not faked


def test_chart_ticks_are_round_and_cover_the_highest_bar() -> None:
    assert charts.nice_ticks(123_000) == [0, 25_000, 50_000, 75_000, 100_000, 125_000]
    assert charts.nice_ticks(9.3) == [0, 2, 4, 6, 8, 10]


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
        "starlette/step/tether": run(10.0, [(*write, 0.5), ("wait", "tether core", 0.5)]),
        "starlette/step/handoff": run(8.0, [(*write, 1.0)]),
    }
    meta = {"date": "today", "command": "c", "window": 5.0, "load": 0.0}
    lines = profiling.render(runs, meta).splitlines()
    assert "#### starlette, streaming from an engine step (`deliver_many`)" in lines
    assert "| function | area | tether | hand-off |" in lines
    assert "| `write` | asyncio | 5.0 (50.0%) | 8.0 (100.0%) |" in lines
    assert "| `wait` | tether core | 5.0 (50.0%) | - |" in lines
    assert "| tether core | 5.0 (50%) | 0.0 (0%) |" in lines
    assert not any(line.startswith("#### aiohttp") for line in lines)


@pytest.mark.skipif(instructions.valgrind() is None, reason="valgrind is installed by .ci/run")
def test_instruction_counts_per_request_are_the_same_from_run_to_run() -> None:
    def count(variant: str, requests: int) -> int:
        return instructions.count(processes.ROOT, "json", variant, requests)

    few = count("raw", 20)
    assert count("raw", 20) == pytest.approx(few, rel=0.001)  # (the hash seed is fixed)
    raw = (count("raw", 120) - few) / 110
    tether = (count("tether", 120) - count("tether", 20)) / 110
    assert 100_000 < raw < tether  # the same requests, and tether does more for each


def test_gc_clock_times_every_collection_beside_the_process_cpu() -> None:
    clock = GcClock()
    before = clock.read()
    clock.install()
    try:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    finally:
        clock.uninstall()
    after = clock.read()
    assert after["collections"][2] - before["collections"][2] == 1
    assert after["collections"][0] - before["collections"][0] >= 1
    assert after["gc_s"] > before["gc_s"]
    assert after["cpu_s"] >= before["cpu_s"]
    gc.collect()  # uninstalled: no longer counted
    assert clock.read()["collections"] == after["collections"]


def test_profile_tables_say_what_the_collector_took_of_each_server() -> None:
    def run(cost: float, share: float) -> dict[str, Any]:
        gc_clock = {"gc_s": share, "cpu_s": 1.0, "collections": [30, 3, 1], "share": share}
        own = [("write", "asyncio", 1.0)]
        shares = {"areas": {"asyncio": 1.0}, "own": own, "layers": []}
        return {"cost": cost, "samples": 10, **shares, "gc": gc_clock}

    runs = {"aiohttp/json/tether": run(100.0, 0.2), "aiohttp/json/handoff": run(50.0, 0.1)}
    meta = {"date": "today", "command": "c", "window": 5.0, "load": 0.0}
    text = profiling.render(runs, meta)
    assert "tether 20.0 (20%; 30/3/1 collections)" in text
    assert "hand-off 5.0 (10%; 30/3/1 collections)" in text


@pytest.mark.skipif(profiling.py_spy() is None, reason="py-spy is installed by `make bench` only")
def test_profile_of_a_running_server_accounts_for_its_samples(tmp_path: Path) -> None:
    result = profiling.record("aiohttp", "limit", "stream", "/stream?n=64", 1.0, into=tmp_path)
    assert (tmp_path / result["stacks"]).stat().st_size > 0
    assert result["samples"] > 0
    assert result["load"]["bad_responses"] == 0
    assert sum(result["areas"].values()) == pytest.approx(1.0)
    assert "aiohttp" in result["areas"]
    assert result["gc"]["cpu_s"] > 0  # the server's collector clock was read around the window


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


@pytest.mark.parametrize("variant", ["handoff", "tether"])
@pytest.mark.parametrize("section", ["json", "stream"])
async def test_the_in_process_aiohttp_path_answers_every_request_whole(
    variant: str, section: str
) -> None:
    async with asyncio.timeout(30):
        bodies = await aiohttp_path.run(variant, section, 30, 3, "step")
    assert len(bodies) == 3
    for body in bodies:
        if section == "json":  # the last output, as JSON
            assert json.loads(body) == {"n": aiohttp_path.EVENTS - 1, "delta": "lorem"}
        else:  # every output as an SSE event, then the terminal one
            assert body.count(b"data: {") == aiohttp_path.EVENTS
            assert body.endswith(b"data: [DONE]\n\n")


def test_a_partial_run_keeps_the_other_benchmarks_recorded_results_with_their_date(
    tmp_path: Path,
) -> None:
    recorded = json.loads((processes.ROOT / "bench" / "results" / "http.json").read_text())
    path = tmp_path / "http.json"
    path.write_text(json.dumps(recorded))
    out: dict[str, Any] = {"batch": {}, "disconnect": recorded["disconnect"], "memory": {}}
    out["meta"] = {**recorded["meta"], "date": "2099-01-01 00:00 UTC"}
    run.keep_earlier(out, ["disconnect"], path)
    assert out["batch"] == recorded["batch"]
    assert out["memory"] == recorded["memory"]
    earlier = recorded["meta"].get("sections", {})
    assert out["meta"]["sections"] == {
        "batch": earlier.get("batch", recorded["meta"]["date"]),
        "disconnect": "2099-01-01 00:00 UTC",
        "memory": earlier.get("memory", recorded["meta"]["date"]),
    }
    text = report.render(out)
    assert "### Batch streaming" in text
    assert "### Memory: idle open streams" in text
    assert "Not re-run by this run, kept as recorded: batch (" in text
