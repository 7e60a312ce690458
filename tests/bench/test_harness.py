"""Keeps the HTTP benchmark harness from rotting: one short load run against a raw
server, and the README rewrite that must leave other sections alone. No benchmark
numbers are checked here, only that the harness measures something sane."""

from __future__ import annotations

from pathlib import Path

from bench import report, run


def test_load_client_streams_every_event_from_a_raw_server() -> None:
    with run.server("aiohttp", "raw") as (pid, base):
        result = run.client(
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


def test_readme_rewrite_appends_the_section_when_markers_are_missing(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\ncore section\n")
    report.rewrite_readme(readme, "tables")
    assert (
        readme.read_text()
        == f"# Benchmarks\n\ncore section\n\n{report.BEGIN}\ntables\n{report.END}\n"
    )
