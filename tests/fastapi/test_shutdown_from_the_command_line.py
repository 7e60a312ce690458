"""Drain on shutdown under each ASGI server's own command line, with only tether's
middleware installed: no server subclass, no lifespan helper.

Each server runs ``draining_app:app`` as a subprocess on 127.0.0.1 (an ephemeral
port, read from its log). The test opens two endless streams and one endless JSON
wait, sends the signal itself, and checks that every stream ended with one 503
error event and the terminal frame, that the JSON wait got a 503, that the server
exited within the drain timeout (plus a bound for start-up noise) and that it
logged no traceback. Without the drain, each of these servers waits for the
endless requests for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest

from tests._support.tracebacks import tracebacks_through
from tests._support.waiting import eventually

HERE: Final = pathlib.Path(__file__).resolve().parent

BOUND: Final = 10.0
"""A generous bound on every wait that is not the drain itself."""

DRAIN: Final = 1
"""The drain timeout given to the app (and hypercorn's graceful timeout)."""

ENDLESS: Final = {"max_tokens": 10**6}
"""A request that would run for hours at the app's pace."""

PYTHON: Final = (sys.executable, "-u", "-m")

COMMANDS: Final = {
    "uvicorn": (*PYTHON, "uvicorn", "draining_app:app", "--host", "127.0.0.1", "--port", "0"),
    "uvicorn.run": (
        sys.executable,
        "-u",
        "-c",
        "import uvicorn; uvicorn.run('draining_app:app', host='127.0.0.1', port=0)",
    ),
    "fastapi-run": (
        *PYTHON,
        "fastapi",
        "run",
        "draining_app.py",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ),
    "uvicorn-reload": (
        *PYTHON,
        "uvicorn",
        "draining_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--reload",
    ),
    "uvicorn-workers": (
        *PYTHON,
        "uvicorn",
        "draining_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--workers",
        "2",
    ),
    "gunicorn": (
        *PYTHON,
        "gunicorn",
        "draining_app:app",
        "--worker-class",
        "uvicorn.workers.UvicornWorker",
        "--bind",
        "127.0.0.1:0",
    ),
    "hypercorn": (
        *PYTHON,
        "hypercorn",
        "draining_app:app",
        "--bind",
        "127.0.0.1:0",
        "--graceful-timeout",
        str(DRAIN),
    ),
    "hypercorn-workers-0": (
        *PYTHON,
        "hypercorn",
        "draining_app:app",
        "--bind",
        "127.0.0.1:0",
        "--workers",
        "0",
    ),
}

CASES: Final = [
    pytest.param("uvicorn", signal.SIGINT, id="uvicorn-SIGINT"),
    pytest.param("uvicorn", signal.SIGTERM, id="uvicorn-SIGTERM"),
    pytest.param("uvicorn.run", signal.SIGINT, id="uvicorn.run-SIGINT"),
    pytest.param("fastapi-run", signal.SIGINT, id="fastapi-run-SIGINT"),
    pytest.param("fastapi-run", signal.SIGTERM, id="fastapi-run-SIGTERM"),
    pytest.param("uvicorn-reload", signal.SIGTERM, id="uvicorn-reload-SIGTERM"),
    pytest.param("uvicorn-workers", signal.SIGTERM, id="uvicorn-workers-SIGTERM"),
    # SIGINT is gunicorn's quick shutdown (its workers get SIGQUIT): SIGTERM drains.
    pytest.param("gunicorn", signal.SIGTERM, id="gunicorn-uvicorn-worker-SIGTERM"),
    pytest.param("hypercorn", signal.SIGINT, id="hypercorn-SIGINT"),
    pytest.param("hypercorn", signal.SIGTERM, id="hypercorn-SIGTERM"),
    pytest.param("hypercorn-workers-0", signal.SIGINT, id="hypercorn-workers-0-SIGINT"),
    pytest.param("hypercorn-workers-0", signal.SIGTERM, id="hypercorn-workers-0-SIGTERM"),
]

URL: Final = re.compile(r"https?://127\.0\.0\.1:([1-9][0-9]*)")


@dataclasses.dataclass
class Server:
    """A server process, its base URL, and every line it printed so far."""

    process: asyncio.subprocess.Process
    output: list[str]
    url: str = ""

    def tracebacks(self) -> list[str]:
        return [line for line in self.output if "Traceback" in line or "ERROR" in line]

    def tracebacks_through_the_app(self) -> list[str]:
        """The tracebacks that show a frame of tether or of the app (hypercorn logs
        one of its own for every connection it cancels at its graceful timeout)."""
        return tracebacks_through("\n".join(self.output), HERE / "draining_app.py")


@contextlib.asynccontextmanager
async def running(command: tuple[str, ...]) -> AsyncIterator[Server]:
    """Run ``command`` in the app's directory until the block ends (then killed if
    it still runs); the output is complete once the block has exited."""
    path = os.pathsep.join((str(HERE), str(HERE.parents[1])))  # the app, and tests._support
    env = {**os.environ, "PYTHONPATH": path, "TETHER_DRAIN_TIMEOUT": str(DRAIN)}
    process = await asyncio.create_subprocess_exec(
        *command,
        cwd=HERE,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # the test's signals reach the server alone
    )
    assert process.stdout is not None  # asked for a pipe above
    server = Server(process, [])
    url: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_output(stdout: asyncio.StreamReader) -> None:
        async for raw in stdout:
            line = raw.decode(errors="replace").rstrip()
            server.output.append(line)
            found = URL.search(line)
            if found and not url.done():
                url.set_result(f"http://127.0.0.1:{found.group(1)}")
        if not url.done():
            url.set_exception(AssertionError("no URL:\n" + "\n".join(server.output)))

    async def answers() -> bool:
        # (uvicorn's supervisor prints the URL before its workers listen)
        async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as client:
            try:
                return (await client.get("/in_flight")).status_code == 200
            except httpx.ConnectError:
                return False

    reader = asyncio.create_task(read_output(process.stdout))
    try:
        async with asyncio.timeout(30):
            server.url = await url
        await eventually(answers, timeout=30)
        yield server
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        async with asyncio.timeout(BOUND):
            await reader


async def read_stream(client: httpx.AsyncClient, first: asyncio.Event) -> list[Any]:
    """POST an endless streaming request; its events, read to the end."""
    events: list[Any] = []
    async with client.stream("POST", "/generate", json={**ENDLESS, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()
    return events


def ends_with_one_503_event(events: list[Any]) -> bool:
    errors = [event for event in events[:-1] if "error" in event]
    return (
        events[-1:] == ["[DONE]"]
        and len(errors) == 1
        and events[-2] is errors[0]
        and errors[0]["error"]["code"] == 503
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("server_name", "sig"), CASES)
async def test_requests_in_flight_end_properly_when_the_server_stops(
    server_name: str, sig: signal.Signals
) -> None:
    async with (
        running(COMMANDS[server_name]) as server,
        httpx.AsyncClient(base_url=server.url, timeout=BOUND + DRAIN) as client,
    ):
        firsts = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(read_stream(client, first)) for first in firsts]
        waiting = asyncio.create_task(client.post("/generate", json=ENDLESS))
        async with asyncio.timeout(BOUND):
            await asyncio.gather(*(first.wait() for first in firsts))

        async def all_in_flight() -> bool:
            return (await client.get("/in_flight")).json() == 3

        # (with several workers, the three may be spread: any worker that has all
        # three in flight is not needed, so only the streams' first events are awaited)
        if "workers" not in server_name:
            await eventually(all_in_flight)
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        server.process.send_signal(sig)
        async with asyncio.timeout(DRAIN + BOUND):
            events = await asyncio.gather(*streams)
            answer = await waiting
            code = await server.process.wait()
        took = loop.time() - sent_at

    for stream_events in events:
        assert ends_with_one_503_event(stream_events), stream_events[-3:]
    assert answer.status_code == 503, answer.text
    assert code in (0, -sig), server.output
    assert took < DRAIN + 5.0, server.output
    if server_name == "hypercorn":
        # Its workers take the shutdown from their parent, with no signal: the drain
        # is hypercorn's graceful timeout, then tether's cancellation path.
        assert server.tracebacks_through_the_app() == [], "\n".join(server.output)
    else:
        assert server.tracebacks() == [], "\n".join(server.output)
