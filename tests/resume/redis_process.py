"""A ``redis-server`` that a test starts on a free loopback port and then breaks on
purpose: paused (SIGSTOP: it accepts connections and answers nothing), restarted empty
on the same port (no persistence), killed, or capped with ``maxclients``."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from typing import Final

__all__ = ["RedisProcess", "redis_process"]

_START: Final = 10.0
"""Seconds a server gets to accept connections."""


class RedisProcess:
    """One ``redis-server`` on ``127.0.0.1:port``, stopped by pid."""

    def __init__(self, binary: str, port: int, maxclients: int | None) -> None:
        self._binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self._maxclients = maxclients
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start it (empty: nothing is saved or loaded) and wait until it accepts."""
        options = [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        if self._maxclients is not None:
            options += ["--maxclients", str(self._maxclients)]
        self._process = process = await asyncio.create_subprocess_exec(
            self._binary, *options,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        async with asyncio.timeout(_START):
            while not await _accepts(self.port):
                if process.returncode is not None:
                    raise RuntimeError(f"redis-server exited with {process.returncode}")
                await asyncio.sleep(0.01)

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
        if process is None or process.returncode is not None:
            return
        process.kill()
        process.send_signal(signal.SIGCONT)
        await process.wait()

    async def restart(self) -> None:
        """Killed and started again on the same port, empty (a restart with no
        persistence, as a cache is run)."""
        await self.kill()
        await self.start()


async def _accepts(port: int) -> bool:
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


@contextlib.asynccontextmanager
async def redis_process(*, maxclients: int | None = None) -> AsyncIterator[RedisProcess]:
    """A :class:`RedisProcess` for the duration of the block, killed after."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = RedisProcess(binary, port, maxclients)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()
