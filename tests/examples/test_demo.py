"""``make demo`` end to end, shortened: every example server, every check, exit status 0."""

from __future__ import annotations

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
    assert out.rstrip().endswith("all checks passed")
