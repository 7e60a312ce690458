"""Fixtures of the ZeroMQ link's tests: an address on each transport (``ipc://`` and
loopback TCP), a bounded poll, and engine or front processes a test can kill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests._support.waiting import eventually as eventually

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    """A short private directory for ipc:// endpoints (their paths are limited to ~100 bytes)."""
    path = tempfile.mkdtemp(prefix="tz-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class LogClock:
    """The clock of every log throttle built while a test runs: still until moved."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def log_clock(monkeypatch: pytest.MonkeyPatch) -> LogClock:
    """Stops the log throttles' clock (for ends built after it): a test sees exactly a
    throttle's burst, however long it runs, and moves time on with ``advance``."""
    import tether_zmq._throttle as throttle  # (the clock is the module's own)

    clock = LogClock()
    monkeypatch.setattr(throttle, "_clock", clock)
    return clock


@pytest.fixture(params=["ipc", "tcp"])
def address(request: pytest.FixtureRequest, ipc_dir: str) -> str:
    """Where an engine binds: an ipc:// path, or loopback TCP on a port the OS picks
    (``EngineServer.address`` holds the bound one after ``start()``)."""
    if request.param == "ipc":
        return f"ipc://{ipc_dir}/engine"
    return "tcp://127.0.0.1:0"


def fixed_address(transport: str, ipc_dir: str) -> str:
    """An address that stays the same across an engine's restarts."""
    if transport == "ipc":
        return f"ipc://{ipc_dir}/engine"
    import socket

    with socket.socket() as probe:  # a free port now; the engine binds it right after
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


class Process:
    """A helper process (``engine_proc.py`` or ``front_proc.py``) and the JSON lines it
    printed so far."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []
        self.stderr = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def find(self, key: str) -> list[dict[str, Any]]:
        return [event for event in self.events if key in event]

    async def first(self, key: str, *, timeout: float = 10.0) -> dict[str, Any]:
        await eventually(lambda: bool(self.find(key)), timeout=timeout)
        return self.find(key)[0]


@contextlib.asynccontextmanager
async def spawned(script: str, *args: str) -> AsyncIterator[Process]:
    """Run ``script`` from this directory with ``args``; killed and reaped on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        str(HERE / script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    helper = Process(process)
    assert process.stdout is not None
    assert process.stderr is not None

    async def read(stdout: asyncio.StreamReader) -> None:
        async for line in stdout:
            helper.events.append(json.loads(line))

    reader = asyncio.create_task(read(process.stdout))
    try:
        yield helper
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)  # (a stopped process dies only once resumed)
                process.kill()
        async with asyncio.timeout(10):
            helper.stderr = await process.stderr.read()
            await process.wait()
            await reader


@contextlib.asynccontextmanager
async def engine_process(
    address: str, *, peer_timeout: float = 0.05, step: float = 0.002
) -> AsyncIterator[tuple[Process, str]]:
    """An engine process bound to ``address``; yields it and the bound address."""
    async with spawned("engine_proc.py", address, str(peer_timeout), str(step)) as engine:
        ready = await engine.first("ready")
        yield engine, str(ready["ready"])


EXAMPLES = HERE.parents[1] / "examples"


class ExampleEngine:
    """``examples/engine_server.py`` in its own process: its bound address and the JSON
    reports it printed (one per SIGUSR1)."""

    def __init__(self, process: asyncio.subprocess.Process, address: str) -> None:
        self.process = process
        self.address = address
        self.reports: list[dict[str, Any]] = []

    async def report(self) -> dict[str, Any]:
        """Ask for the engine's counters (SIGUSR1) and wait for them."""
        seen = len(self.reports)
        self.process.send_signal(signal.SIGUSR1)
        await eventually(lambda: len(self.reports) > seen)
        return self.reports[-1]


@contextlib.asynccontextmanager
async def example_engine(address: str, *args: str) -> AsyncIterator[ExampleEngine]:
    """Run the example engine on ``address``; stopped with SIGTERM (exit 0) on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        str(EXAMPLES / "engine_server.py"),
        "--address",
        address,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        async with asyncio.timeout(20):
            line = (await process.stdout.readline()).decode()
        assert line.startswith("tether engine listening on "), line
        engine = ExampleEngine(process, line.rsplit(" ", 1)[-1].strip())

        async def read(stdout: asyncio.StreamReader) -> None:
            async for line in stdout:
                engine.reports.append(json.loads(line))

        reader = asyncio.create_task(read(process.stdout))
        try:
            yield engine
        finally:
            if process.returncode is None:
                process.terminate()
            async with asyncio.timeout(10):
                await process.wait()
                await reader
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
