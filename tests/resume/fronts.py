"""Front worker processes (``redis_front``) for the cross-worker tests: started, read
through ``/books``, and stopped by closing their standard input."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tests._support.processes import stop

from .conftest import BOUND

__all__ = ["books", "front", "until"]

ROOT = pathlib.Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def front(
    adapter: str, redis: str, *options: str, output: list[str] | None = None
) -> AsyncIterator[str]:
    """A front worker process (``redis_front``); its base URL. Stopped by closing its
    standard input; its output is shown if it fails to start, and read all along
    (into ``output`` if given: a pipe nobody reads would stall its logging)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-m", "tests.resume.redis_front",
        "--adapter", adapter, "--redis", redis, *options,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stdin is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            async for raw in process.stdout:
                line = raw.decode().rstrip()
                seen.append(line)
                if "listening on " in line:
                    break
        assert seen, "the front printed nothing"
        assert "listening on " in seen[-1], "\n".join(seen)
        kept = output if output is not None else []

        async def drain() -> None:
            assert process.stdout is not None
            async for raw in process.stdout:
                kept.append(raw.decode().rstrip())

        reading = asyncio.create_task(drain())
        try:
            yield seen[-1].rsplit("listening on ", 1)[1]
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
    finally:
        process.stdin.close()
        await stop(process, None, grace=BOUND)


async def books(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/books") as response:
        result: dict[str, Any] = await response.json()
        return result


async def until(session: aiohttp.ClientSession, url: str, check: Any) -> dict[str, Any]:
    """Poll a front's books (bounded) until ``check(books)`` holds; the books."""
    async with asyncio.timeout(BOUND):
        while True:
            found = await books(session, url)
            if check(found):
                return found
            await asyncio.sleep(0.02)
