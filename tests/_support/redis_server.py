"""A ``redis-server`` of the test's own on a free loopback port, stopped by its pid,
that a test may also break on purpose: paused (SIGSTOP: it accepts connections and
answers nothing), restarted empty on the same port (no persistence), killed, or capped
with ``maxclients``. The ``redis_url`` and ``redis_proc`` fixtures run one per test,
each started as a Redis that already serves tether (see ``_established``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from collections.abc import AsyncIterator

import pytest

from tests._support.processes import stop
from tests._support.waiting import eventually

__all__ = ["RedisProcess", "redis_proc", "redis_process", "redis_server", "redis_url"]


class RedisProcess:
    """One ``redis-server`` on ``127.0.0.1:port`` (nothing saved to disk)."""

    def __init__(self, binary: str, port: int, maxclients: int | None, start_timeout: float):
        self._binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self._maxclients = maxclients
        self._start_timeout = start_timeout
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start it (empty: nothing is saved or loaded) and wait until it answers.

        :raises TimeoutError: it did not answer within the start timeout.
        """
        options = ["--port", str(self.port), "--bind", "127.0.0.1"]
        options += ["--save", "", "--appendonly", "no"]  # (nothing saved or loaded)
        if self._maxclients is not None:
            options += ["--maxclients", str(self._maxclients)]
        self._process = process = await asyncio.create_subprocess_exec(
            self._binary, *options,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

        async def up() -> bool:
            if process.returncode is not None:
                raise AssertionError(f"redis-server exited with {process.returncode}")
            return await _answers(self.port)

        await eventually(up, timeout=self._start_timeout)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing is answered."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: it answers again, everything it held intact."""
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        """SIGKILL, and wait for it to be gone (a paused one too)."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()
            process.send_signal(signal.SIGCONT)
            await stop(process, None)

    async def restart(self) -> None:
        """Killed and started again on the same port, empty (a restart with no
        persistence, as a cache is run)."""
        await self.kill()
        await self.start()


async def _answers(port: int) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    try:  # (a socket that connects is not yet a server that answers)
        writer.write(b"PING\r\n")
        await writer.drain()
        async with asyncio.timeout(1):
            return (await reader.readline()).startswith(b"+PONG")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _established(port: int) -> None:
    """Make it a Redis that already serves tether: its stores' epoch key (default
    prefix) is set, as a deployment's running workers keep it. A store that finds no
    epoch cannot tell a new Redis from one restarted empty, and marks it settling (a
    wrong token is a 503 for a settling period); tests of that call ``restart()``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"SET tether:resume:epoch 1 PX 86400000\r\n")
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.readline()
        assert answer.startswith(b"+OK"), answer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def redis_process(
    *, maxclients: int | None = None, start_timeout: float = 10.0
) -> AsyncIterator[RedisProcess]:
    """A :class:`RedisProcess` for the duration of the block, killed after. With no
    ``redis-server`` on PATH the test is skipped (failed under CI, which installs it),
    as the fixtures' tests are.

    :raises TimeoutError: it did not answer within ``start_timeout``.
    """
    binary = _needed()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = RedisProcess(binary, port, maxclients, start_timeout)
    try:
        await server.start()
        await _established(port)
        yield server
    finally:
        await server.kill()


@contextlib.asynccontextmanager
async def redis_server(*, start_timeout: float = 10.0) -> AsyncIterator[str]:
    """Run ``redis-server`` for the block; yields its URL, ``redis://127.0.0.1:PORT``."""
    async with redis_process(start_timeout=start_timeout) as server:
        yield server.url


def _needed() -> str:
    """The path of ``redis-server``; with none on PATH the test is skipped, or failed
    under CI (which installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return binary


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """A :func:`redis_server` for one test (a conftest imports this fixture)."""
    _needed()
    async with redis_server() as url:
        yield url


@pytest.fixture
async def redis_proc() -> AsyncIterator[RedisProcess]:
    """A ``redis-server`` of its own that the test may pause, restart empty or kill."""
    _needed()
    async with redis_process() as server:
        yield server
