"""Stopping the example servers: SIGTERM and Ctrl-C (SIGINT) are the normal way out.

Each server runs as a subprocess on 127.0.0.1 (ephemeral port), as ``make serve``
runs it; the test sends the signal itself, reads every response to its end, and
checks the exit code and what the server wrote on stderr. The uvicorn-based
servers run on each of uvicorn's stacks (h11 or httptools, asyncio's loop or
uvloop: ``conftest.UVICORN_STACKS``), the aiohttp one on both loops; the servers of
one test run at once, so a wait costs its time once per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import cli
import httpx
import pytest
import starlette_app
import uvicorn
from launch import SERVERS

from .conftest import (
    AIOHTTP_STACKS,
    STACK_SETS,
    UVICORN_STACKS,
    Stack,
    eventually,
    stacked,
)

BOUND: Final = 10.0
"""A generous bound on any wait that does not include a drain."""

LONG: Final = 4096
"""``max_tokens`` that keeps the engine producing for 20 s or more (5 ms steps)."""

H11_ASYNCIO, H11_UVLOOP, HTTPTOOLS_ASYNCIO, HTTPTOOLS_UVLOOP = UVICORN_STACKS

LONG_DRAIN_SERVERS: Final = (
    ("starlette", H11_ASYNCIO),
    ("starlette", HTTPTOOLS_UVLOOP),
    ("fastapi", H11_UVLOOP),
    ("fastapi", HTTPTOOLS_ASYNCIO),
    ("aiohttp", AIOHTTP_STACKS[0]),
)
"""The servers of the long-drain test: a covering set rather than every server on
every stack. That test lasts the drain timeout (over 5 s) whatever it runs on, and its
servers run at once on a two-core machine: all ten would starve one another. These five
put each uvicorn-based server on both HTTP implementations and both loops, and
every one of the four stacks under one of them; the short shutdown tests below run
every server on every stack."""


@dataclasses.dataclass
class Server:
    """One example server process, its base URL, and its stderr once it exited."""

    name: str
    process: asyncio.subprocess.Process
    url: str
    stderr: bytes = b""

    def stop(self, sig: signal.Signals) -> float:
        """Send ``sig``; returns the loop time it was sent at."""
        self.process.send_signal(sig)
        return asyncio.get_running_loop().time()

    async def exit_code(self, within: float) -> int:
        async with asyncio.timeout(within):
            return await self.process.wait()


@contextlib.asynccontextmanager
async def serving(name: str, stack: Stack, *args: str) -> AsyncIterator[Server]:
    """Run the example server ``name`` on ``stack`` until the block ends (killed if
    still running); it fails unless the server says it runs on ``stack``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        str(SERVERS[name]),
        "--port",
        "0",
        *stack.args,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None  # (pipes, asked for above)
    assert process.stderr is not None
    server = Server(name, process, "")
    # Read stderr all along, so that a chatty server never blocks on a full pipe.
    errors = asyncio.create_task(process.stderr.read())
    try:
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        if "listening on " in line:
            stack.check(name, line)
            server.url = line.rsplit("listening on ", 1)[1].strip().rstrip("/")
            yield server
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        async with asyncio.timeout(BOUND):
            server.stderr = await errors
    if not server.url:
        raise AssertionError(f"{name} printed no URL: {line!r}\n{server.stderr.decode()}")


@dataclasses.dataclass
class Reading:
    """One streamed response read to its end: its events and when it ended."""

    events: list[Any] = dataclasses.field(default_factory=list)
    first: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    ended_at: float = 0.0
    broken: str = ""
    """How the response broke off (a cut connection, an incomplete body), if it did."""


async def read_stream(client: httpx.AsyncClient, body: dict[str, Any], into: Reading) -> None:
    """POST ``body`` to /generate and read its server-sent events to the end."""
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    into.events.append(data if data == "[DONE]" else json.loads(data))
                    into.first.set()
    except httpx.TransportError as exc:
        into.broken = repr(exc)
    into.ended_at = asyncio.get_running_loop().time()


def problems_of_stream(reading: Reading) -> list[str]:
    """What is wrong with a stream the drain aborted: it must end with one error
    event (503) and the terminal frame, and carry no other error."""
    events = reading.events
    if reading.broken:
        return [f"the stream broke off: {reading.broken}"]
    if events[-1:] != ["[DONE]"]:
        return [f"no terminal frame; last events {events[-2:]}"]
    errors = [event for event in events[:-1] if "error" in event]
    if len(errors) != 1 or events[-2] is not errors[0] or errors[0]["error"]["code"] != 503:
        return [f"expected one 503 error event before [DONE], got {errors}"]
    return []


async def post_json(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response | str:
    """POST ``body`` to /generate: the response, or how the connection broke off."""
    try:
        return await client.post("/generate", json=body)
    except httpx.TransportError as exc:
        return repr(exc)


async def has_in_flight(client: httpx.AsyncClient, expected: int) -> bool:
    """Whether the server has ``expected`` request ids in flight (its /stats)."""
    metrics = (await client.get("/stats")).json()
    return bool(metrics["in_flight"] == expected)


async def drain_for_long(name: str, stack: Stack, drain_timeout: float) -> list[str]:
    """SIGTERM to server ``name`` on ``stack`` while streams and JSON waits are in
    flight, with a drain timeout above uvicorn's default grace of 5 s; returns what
    went wrong."""
    async with (
        serving(name, stack, "--drain-timeout", str(drain_timeout)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=drain_timeout + BOUND) as client,
        asyncio.TaskGroup() as group,
    ):
        streams = [Reading() for _ in range(3)]
        bodies: list[dict[str, Any]] = [{"text": "a"}, {"text": "b"}, {"text": ["c", "d"]}]
        for reading, body in zip(streams, bodies, strict=True):
            group.create_task(
                read_stream(client, {**body, "max_tokens": LONG, "stream": True}, reading)
            )
        waits = [
            group.create_task(post_json(client, {"text": text, "max_tokens": LONG}))
            for text in (["e"], "f")
        ]
        async with asyncio.timeout(BOUND):
            for reading in streams:
                await reading.first.wait()
        await eventually(lambda: has_in_flight(client, 6))  # 4 streamed, 2 waiting

        sent_at = server.stop(signal.SIGTERM)
        code = await server.exit_code(within=drain_timeout + cli.SHUTDOWN_MARGIN)
        exited_after = asyncio.get_running_loop().time() - sent_at

    found = [f"exit code {code}"] if code != 0 else []
    if b"Traceback" in server.stderr or server.stderr.strip():
        found.append(f"stderr:\n{server.stderr.decode(errors='replace')}")
    for reading in streams:
        found.extend(problems_of_stream(reading))
        if reading.ended_at - sent_at < drain_timeout - 0.5:
            found.append(f"a stream ended {reading.ended_at - sent_at:.1f}s after SIGTERM")
    for wait in waits:
        response = wait.result()
        if isinstance(response, str):
            found.append(f"JSON wait broke off: {response}")
        elif response.status_code not in (200, 503) or "json" not in response.headers.get(
            "content-type", ""
        ):
            found.append(f"JSON wait answered {response.status_code}: {response.text!r}")
        elif response.status_code == 503 and response.json()["error"]["code"] != 503:
            found.append(f"JSON wait answered {response.text!r}")
    if exited_after < drain_timeout - 0.5:
        found.append(f"exited {exited_after:.1f}s after SIGTERM: the drain was cut short")
    return [f"{name} on {stack.id}: {problem}" for problem in found]


async def test_sigterm_during_a_drain_longer_than_5s_completes_every_response_and_exits_0() -> None:
    drain_timeout = 6.0
    found = await asyncio.gather(
        *(drain_for_long(name, stack, drain_timeout) for name, stack in LONG_DRAIN_SERVERS)
    )
    problems = [problem for problems in found for problem in problems]
    assert not problems, "\n".join(problems)


def test_the_long_drain_covers_every_stack_and_each_server_on_both_of_each() -> None:
    """What the covering set of :data:`LONG_DRAIN_SERVERS` promises, kept true."""
    assert {stack for _, stack in LONG_DRAIN_SERVERS} >= set(UVICORN_STACKS)
    for name in ("starlette", "fastapi"):
        stacks = [stack for server, stack in LONG_DRAIN_SERVERS if server == name]
        assert {stack.http for stack in stacks} == {"h11", "httptools"}, name
        assert {stack.loop for stack in stacks} == {"asyncio", "uvloop"}, name


async def stop_with(name: str, stack: Stack, sig: signal.Signals) -> list[str]:
    """``sig`` to server ``name`` on ``stack`` with a stream in flight; returns what
    went wrong."""
    async with (
        serving(name, stack, "--drain-timeout", "0.2") as server,
        httpx.AsyncClient(base_url=server.url, timeout=BOUND) as client,
    ):
        reading = Reading()
        body = {"text": "a", "max_tokens": LONG, "stream": True}
        reader = asyncio.create_task(read_stream(client, body, reading))
        try:
            async with asyncio.timeout(BOUND):
                await reading.first.wait()
            server.stop(sig)
            code = await server.exit_code(within=BOUND)
            async with asyncio.timeout(BOUND):
                await reader
        finally:
            reader.cancel()
            await asyncio.wait([reader])
    found = [f"exit code {code}"] if code != 0 else []
    if server.stderr.strip():
        found.append(f"stderr:\n{server.stderr.decode(errors='replace')}")
    found.extend(problems_of_stream(reading))
    return [f"{name} on {stack.id}: {problem}" for problem in found]


@pytest.mark.parametrize("servers", STACK_SETS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_a_signal_drains_open_streams_and_exits_0_without_a_traceback(
    sig: signal.Signals, servers: Sequence[tuple[str, Stack]]
) -> None:
    found = await asyncio.gather(*(stop_with(name, stack, sig) for name, stack in servers))
    problems = [problem for problems in found for problem in problems]
    assert not problems, "\n".join(problems)


async def stop_at_once(name: str, stack: Stack) -> int:
    async with serving(name, stack) as server:
        server.stop(signal.SIGTERM)
        return await server.exit_code(within=BOUND)


@pytest.mark.parametrize("servers", STACK_SETS)
async def test_a_sigterm_as_soon_as_the_url_is_printed_is_a_clean_exit(
    servers: Sequence[tuple[str, Stack]],
) -> None:
    """A supervisor may stop a server the moment it says it is up: its signal handlers
    must already be in place then."""
    codes = await asyncio.gather(*(stop_at_once(name, stack) for name, stack in servers))
    assert codes == [0] * len(servers), stacked(servers)


async def refuses_connections(url: str) -> bool:
    """Whether the server stopped listening (its shutdown began)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except (ConnectionRefusedError, ConnectionResetError):
        # (reset: the connection reached the backlog as the listener was closed)
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def hurry_with_a_second_ctrl_c(name: str, stack: Stack) -> list[str]:
    """Ctrl-C twice to server ``name`` on ``stack`` during a 60 s drain; returns what
    went wrong."""
    async with (
        serving(name, stack, "--drain-timeout", "60") as server,
        httpx.AsyncClient(base_url=server.url, timeout=BOUND) as client,
    ):
        reading = Reading()
        body = {"text": "a", "max_tokens": LONG, "stream": True}
        reader = asyncio.create_task(read_stream(client, body, reading))
        try:
            async with asyncio.timeout(BOUND):
                await reading.first.wait()
            server.stop(signal.SIGINT)
            await eventually(lambda: refuses_connections(server.url))
            server.stop(signal.SIGINT)
            code = await server.exit_code(within=BOUND)
            async with asyncio.timeout(BOUND):
                await reader
        finally:
            reader.cancel()
            await asyncio.wait([reader])
    found = [f"exit code {code}"] if code != 0 else []
    if server.stderr.strip():
        found.append(f"stderr:\n{server.stderr.decode(errors='replace')}")
    found.extend(problems_of_stream(reading))
    return [f"{name} on {stack.id}: {problem}" for problem in found]


@pytest.mark.parametrize("servers", STACK_SETS)
async def test_a_second_ctrl_c_ends_the_drain_at_once_and_still_exits_0(
    servers: Sequence[tuple[str, Stack]],
) -> None:
    found = await asyncio.gather(
        *(hurry_with_a_second_ctrl_c(name, stack) for name, stack in servers)
    )
    problems = [problem for problems in found for problem in problems]
    assert not problems, "\n".join(problems)


def test_uvicorns_traceback_for_a_handler_cancelled_at_shutdown_becomes_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler still running when uvicorn's grace period ends is cancelled; it ends
    its response, then lets the cancellation go on, which uvicorn logs with a traceback.
    The example server says it in one line instead, and only while shutting down."""
    server = starlette_app.Server(uvicorn.Config(app=None, log_config=None))
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(server.cancelled_at_shutdown)  # as server.run() does
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            uvicorn_log.error("Exception in ASGI application\n", exc_info=RuntimeError("bug"))
            server.should_exit = True
            uvicorn_log.error("Exception in ASGI application\n", exc_info=RuntimeError("bug"))
            uvicorn_log.error("Exception in ASGI application\n", exc_info=asyncio.CancelledError())
    finally:
        uvicorn_log.removeFilter(server.cancelled_at_shutdown)

    bug, bug_at_shutdown, cancelled = caplog.records
    assert bug.exc_info is not None
    assert bug_at_shutdown.exc_info is not None  # a real error keeps its traceback
    assert cancelled.exc_info is None
    assert cancelled.levelno == logging.WARNING
    assert cancelled.getMessage() == "a request still running at shutdown was cancelled"
