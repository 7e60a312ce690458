"""The example servers scaled out: ``engine_server.py`` in its own process and each
server with ``--engine ADDRESS --workers 2`` (the demo's scale-out scene, shortened)."""

from __future__ import annotations

import pytest
import scaleout  # (an example module: tests/examples/conftest.py puts examples/ on the path)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("server", ["starlette", "aiohttp"])
async def test_two_workers_share_one_engine_survive_its_kill_and_one_worker_s_kill(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    clean = await scaleout.scene(server, seconds=1.0, clients=4)
    out = capsys.readouterr().out
    assert clean, out
    assert "engine fronts 2" in out
    assert "16/16 streams ended with an error event" in out
    assert "a new request got 503 (Retry-After: 1)" in out
