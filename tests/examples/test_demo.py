"""``make demo`` end to end, shortened: every example server, every check, exit status 0."""

from __future__ import annotations

import shutil
import subprocess
import sys

from .conftest import EXAMPLES


def test_demo_prints_a_clean_table_for_every_server_and_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--seconds", "1.5", "--clients", "6"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Starlette on uvicorn at http://127.0.0.1:" in out
    assert "aiohttp at http://127.0.0.1:" in out
    assert "FastAPI on uvicorn at http://127.0.0.1:" in out
    for line in ("in_flight after run: 0", "engine slots after run: 0", "disconnect -> abort"):
        assert out.count(line) == 3, line
    # the resumption scene: a quarter of the streams dropped and resumed, every token once
    assert "Resumable streams: 25% of the streams dropped mid-stream and resumed" in out
    rows = [line.strip() for line in out.splitlines()]
    settings = ["starlette alone", "aiohttp alone", "fastapi alone"]
    if shutil.which("redis-server"):  # (.ci/run installs it)
        settings.append("starlette <-> aiohttp (Redis)")
    for where in settings:
        assert any(row.startswith(where) and row.endswith("OK") for row in rows), where
    assert out.rstrip().endswith("all checks passed")
