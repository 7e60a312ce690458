"""Where tether's log records go: nowhere until the application says (a library adds
a ``NullHandler`` and configures nothing), and, in the example servers and with the
uvicorn configuration that ``docs/starlette.md`` shows, through the server's own
formatter with their level, time and logger name."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from .conftest import EXAMPLES, served

ROOT = EXAMPLES.parent

# A tether error line, as the example servers and the documented configuration write it:
# the level first (uvicorn's padded "ERROR:    ", or logging's "ERROR"), then the time,
# the logger's name and the message.
UVICORN_LINE = re.compile(r"^ERROR: +\d{4}-\d\d-\d\d [\d:,]+ tether: request '[^']+' failed")
LOGGING_LINE = re.compile(r"^ERROR \d{4}-\d\d-\d\d [\d:,]+ tether: request '[^']+' failed")

FAILING_APP = """
import tether
import tether_starlette
from starlette.applications import Starlette
from starlette.routing import Route

registry = tether.Registry()


async def fail(request):
    stream = registry.open()
    registry.fail(stream.rid, RuntimeError("the engine's own words"))
    return await tether_starlette.respond(request, stream, streaming=False)


app = Starlette(routes=[Route("/fail", fail)])
app.add_middleware(tether_starlette.TetherMiddleware, registry=registry)
"""


def test_tether_configures_no_logging_and_shows_nothing_unasked() -> None:
    """Not even through Python's last-resort handler, which prints a record bare."""
    code = textwrap.dedent("""
        import logging, tether, tether_starlette, tether_aiohttp
        assert logging.getLogger().handlers == []
        handlers = logging.getLogger("tether").handlers
        assert [type(h) for h in handlers] == [logging.NullHandler], handlers
        logging.getLogger("tether.starlette").error("unseen")
        print("ok")
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


@pytest.mark.parametrize(("name", "line"), [("starlette", UVICORN_LINE), ("aiohttp", LOGGING_LINE)])
async def test_an_example_server_logs_a_tether_error_with_level_time_and_logger(
    name: str, line: re.Pattern[str]
) -> None:
    async with (
        served(name, "--fail-fraction", "1") as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as client,
    ):
        response = await client.post("/generate", json={"text": "hi", "max_tokens": 4})
        assert response.status_code == 500, response.text
        assert "SimulatedFailure" not in response.text  # logged, not sent
    errors = [text for text in server.output if line.match(text)]
    assert len(errors) == 1, "\n".join(server.output)
    assert any("SimulatedFailure" in text for text in server.output)  # and its traceback


async def test_the_documented_log_config_routes_tether_under_the_uvicorn_command(
    tmp_path: Path,
) -> None:
    guide = (ROOT / "docs" / "starlette.md").read_text()
    (config,) = re.findall(r"```json\n(.*?)```", guide, re.DOTALL)
    (tmp_path / "logging.json").write_text(textwrap.dedent(config))
    (tmp_path / "app.py").write_text(FAILING_APP)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        "app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-config",
        "logging.json",
        cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(30):
            while not (port := _port(lines)):
                raw = await process.stderr.readline()
                assert raw, "\n".join(lines)
                lines.append(raw.decode().rstrip())
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(f"http://127.0.0.1:{port}/fail")
            assert response.status_code == 500
    finally:
        process.terminate()
        async with asyncio.timeout(10):
            _, rest = await process.communicate()
    lines += (rest or b"").decode().splitlines()
    assert [text for text in lines if UVICORN_LINE.match(text)], "\n".join(lines)
    assert any("the engine's own words" in text for text in lines)  # its traceback


def _port(lines: list[str]) -> int:
    for text in lines:
        if found := re.search(r"running on http://127\.0\.0\.1:(\d+)", text):
            return int(found.group(1))
    return 0
