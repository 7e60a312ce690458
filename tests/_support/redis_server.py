"""A ``redis-server`` of the test's own on a free loopback port, stopped by its pid,
and the ``redis_url`` fixture that runs one per test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
from collections.abc import AsyncIterator

import pytest

from tests._support.processes import stop
from tests._support.waiting import eventually


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@contextlib.asynccontextmanager
async def redis_server(*, start_timeout: float = 10.0) -> AsyncIterator[str]:
    """Run ``redis-server`` on 127.0.0.1 (nothing saved to disk) for the block; yields
    its URL, ``redis://127.0.0.1:PORT``.

    :raises FileNotFoundError: there is no ``redis-server`` on PATH.
    :raises TimeoutError: it did not accept connections within ``start_timeout``.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    process = await asyncio.create_subprocess_exec(
        binary,
        "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:

        async def up() -> bool:
            if process.returncode is not None:
                raise AssertionError(f"redis-server exited with {process.returncode}")
            return await _accepts(port)

        await eventually(up, timeout=start_timeout)
        yield f"redis://127.0.0.1:{port}"
    finally:
        await stop(process)


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """A :func:`redis_server` for one test (a conftest imports this fixture)."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    async with redis_server() as url:
        yield url
