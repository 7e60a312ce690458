"""Fixtures for the example servers' tests: the examples directory on ``sys.path``, a
bounded poll, and a server subprocess whose output a test can read."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# The examples are scripts (``python examples/starlette_app.py``) that import their
# siblings as top-level modules; tests import them the same way.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import launch  # noqa: E402  (an example module: importable once the path is set)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout: float = 10.0
) -> None:
    """Wait until ``predicate()`` holds, polling, for conditions that have no event
    to wait on (another process's counters, a scheduler's next step); bounded."""
    async with asyncio.timeout(timeout):
        while True:
            held = predicate()
            if not isinstance(held, bool):
                held = await held
            if held:
                return
            await asyncio.sleep(0.005)


@dataclasses.dataclass
class Served:
    """An example server running as a subprocess, with everything it printed so far."""

    url: str
    output: list[str]

    def failure_lines(self) -> list[str]:
        """The lines of its output that report a failure: a traceback or an error log."""
        return [line for line in self.output if "Traceback" in line or "ERROR" in line.upper()]


@contextlib.asynccontextmanager
async def served(name: str, *args: str) -> AsyncIterator[Served]:
    """Run the example server ``name`` as ``launch.launched`` does (``--port 0`` on
    127.0.0.1, stopped on exit, bounded), but keep its output (stdout and stderr)
    for the test to read: ``launched`` shows it only when the server fails.

    The output is complete once the block has exited (the server has stopped). The
    server is stopped with SIGTERM, as a service manager stops it: uvicorn re-raises
    the signal it caught once it has shut down, and a SIGINT then ends in
    ``asyncio.run``'s KeyboardInterrupt traceback, which says nothing about the
    requests a test sent.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        str(launch.SERVERS[name]),
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None  # asked for a pipe above
    output: list[str] = []
    url: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_output(stdout: asyncio.StreamReader) -> None:
        async for raw in stdout:
            line = raw.decode(errors="replace").rstrip()
            output.append(line)
            if not url.done() and "listening on " in line:
                url.set_result(line.rsplit("listening on ", 1)[1].rstrip("/"))
        if not url.done():
            url.set_exception(RuntimeError(f"{name} server exited:\n" + "\n".join(output)))

    reader = asyncio.create_task(read_output(process.stdout))
    try:
        async with asyncio.timeout(30):
            base = await url
        yield Served(base, output)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
        await reader
