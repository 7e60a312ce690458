"""Fixtures for the example servers' tests: the examples directory on ``sys.path``, a
bounded poll, a server subprocess whose output a test can read, and the server stacks
(uvicorn's HTTP implementation and event loop) the tests about connections and
shutdown run on."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Final

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# The examples are scripts (``python examples/starlette_app.py``) that import their
# siblings as top-level modules; tests import them the same way.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import launch  # noqa: E402  (an example module: importable once the path is set)

from tests._support.processes import stop  # noqa: E402
from tests._support.redis_server import redis_url as redis_url  # noqa: E402
from tests._support.waiting import eventually as eventually  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Stack:
    """What an example server runs on: uvicorn's HTTP implementation (``None`` for
    aiohttp, which has its own) and the event loop."""

    http: str | None
    loop: str

    @property
    def id(self) -> str:
        return f"{self.http}-{self.loop}" if self.http else self.loop

    @property
    def args(self) -> tuple[str, ...]:
        """The command-line options that choose it."""
        http = ("--http", self.http) if self.http else ()
        return (*http, "--loop", self.loop)

    def check(self, name: str, announced: str) -> None:
        """Fail unless the server's first line says it runs on this stack: the
        example prints the stack it resolved (the HTTP protocol class uvicorn loaded,
        the running loop's kind), so this proves the choice took effect."""
        stack = f"http={self.http}, loop={self.loop}" if self.http else f"loop={self.loop}"
        expected = f"tether example ({name}: {stack}) listening on "
        assert expected in announced, f"expected {expected!r}, the server said {announced!r}"


UVICORN_STACKS: Final = tuple(
    Stack(http, loop) for http in ("h11", "httptools") for loop in ("asyncio", "uvloop")
)
"""The four stacks a uvicorn-based example must work on: h11 and httptools parse
requests and resume reading differently, and asyncio's loop and uvloop run the next
request's task from different places (the difference behind issue 17's scope mix-up)."""

AIOHTTP_STACKS: Final = (Stack(None, "asyncio"), Stack(None, "uvloop"))
"""The aiohttp example on its default loop and on uvloop (it has its own HTTP parser:
``--loop`` is its only choice)."""

SERVER_STACKS: Final = (
    *(pytest.param("starlette", stack, id=f"starlette-{stack.id}") for stack in UVICORN_STACKS),
    *(pytest.param("fastapi", stack, id=f"fastapi-{stack.id}") for stack in UVICORN_STACKS),
    *(pytest.param("aiohttp", stack, id=f"aiohttp-{stack.id}") for stack in AIOHTTP_STACKS),
)
"""``(name, stack)`` parameters: each example server on every stack it can run on."""

STACK_SETS: Final = (
    *(
        pytest.param((("starlette", stack), ("fastapi", stack)), id=stack.id)
        for stack in UVICORN_STACKS
    ),
    pytest.param(tuple(("aiohttp", stack) for stack in AIOHTTP_STACKS), id="aiohttp"),
)
"""The same servers as :data:`SERVER_STACKS` grouped by stack, for tests that run
a group at once to pay a wait (a drain, a signal) once per group."""


def stacked(servers: Sequence[tuple[str, Stack]]) -> str:
    """A readable label for a group of ``(name, stack)``, for failure messages."""
    return ", ".join(f"{name} on {stack.id}" for name, stack in servers)


@dataclasses.dataclass
class Served:
    """An example server running as a subprocess, with everything it printed so far."""

    url: str
    output: list[str]

    def failure_lines(self) -> list[str]:
        """The lines of its output that report a failure: a traceback or an error log."""
        return [line for line in self.output if "Traceback" in line or "ERROR" in line.upper()]


@contextlib.asynccontextmanager
async def served(name: str, *args: str, stack: Stack | None = None) -> AsyncIterator[Served]:
    """Run the example server ``name`` as ``launch.launched`` does (``--port 0`` on
    127.0.0.1, stopped on exit, bounded), but keep its output (stdout and stderr)
    for the test to read: ``launched`` shows it only when the server fails. With
    ``stack``, it runs on that stack, and fails unless it says so at start-up.

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
        *(stack.args if stack else ()),
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
                if stack is not None:
                    try:
                        stack.check(name, line)
                    except AssertionError as exc:
                        url.set_exception(exc)
                        continue
                url.set_result(line.rsplit("listening on ", 1)[1].rstrip("/"))
        if not url.done():
            url.set_exception(RuntimeError(f"{name} server exited:\n" + "\n".join(output)))

    reader = asyncio.create_task(read_output(process.stdout))
    try:
        async with asyncio.timeout(30):
            base = await url
        yield Served(base, output)
    finally:
        await stop(process)
        await reader
