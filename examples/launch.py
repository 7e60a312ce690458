"""Start an example server as a subprocess on 127.0.0.1 with an ephemeral port.

``make demo`` and the end-to-end tests use :func:`launched`: it runs
``python examples/<name>_app.py --port 0``, reads the URL the server prints
once it listens, and on exit stops the server by its process id (SIGINT, then
SIGKILL if it does not exit in time), keeping its output for the error message.
:func:`redis_server` runs a ``redis-server`` the same way, for the servers'
``--redis`` (resumable streams shared between servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence

__all__ = ["SERVERS", "ServerFailed", "launched", "redis_server"]

HERE = pathlib.Path(__file__).resolve().parent
SERVERS = {
    "starlette": HERE / "starlette_app.py",
    "aiohttp": HERE / "aiohttp_app.py",
    "fastapi": HERE / "fastapi_app.py",
}
"""The example servers by name."""


class ServerFailed(RuntimeError):
    """The server did not start, or did not stop cleanly; the message holds its output."""


@contextlib.asynccontextmanager
async def launched(
    name: str, args: Sequence[str] = (), *, start_timeout: float = 30.0
) -> AsyncIterator[str]:
    """Run the example server ``name`` for the duration of the block; yields its base URL.

    :param args: extra command-line options (``--max-batch``, ``--fail-fraction``...).
    :raises ServerFailed: it exited or printed no URL within ``start_timeout``, or it
        did not exit within 10 s of SIGINT, or exited with an error.
    """
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        str(SERVERS[name]),
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None  # asked for a pipe above
    lines: list[str] = []
    url: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_output() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            if not url.done() and "listening on " in line:
                url.set_result(line.rsplit("listening on ", 1)[1])
        if not url.done():
            url.set_exception(ServerFailed(f"{name} server exited:\n" + "\n".join(lines)))

    reader = asyncio.create_task(read_output())
    try:
        try:
            async with asyncio.timeout(start_timeout):
                base = await url
        except TimeoutError:
            raise ServerFailed(f"{name} server printed no URL:\n" + "\n".join(lines)) from None
        yield base.rstrip("/")
    finally:
        code = await _stop(process)
        await reader
    if code not in (0, -signal.SIGINT):
        raise ServerFailed(f"{name} server exited with {code}:\n" + "\n".join(lines))


async def _stop(process: asyncio.subprocess.Process, sig: int = signal.SIGINT) -> int:
    """Stop ``process`` with ``sig`` (SIGKILL after 10 s); its exit code."""
    if process.returncode is None:
        process.send_signal(sig)
        try:
            async with asyncio.timeout(10):
                return await process.wait()
        except TimeoutError:
            process.kill()
    return await process.wait()


@contextlib.asynccontextmanager
async def redis_server(*, start_timeout: float = 10.0) -> AsyncIterator[str]:
    """Run a ``redis-server`` of its own on 127.0.0.1 (a free port, nothing saved to
    disk) for the duration of the block; yields its URL, ``redis://127.0.0.1:PORT``.

    :raises FileNotFoundError: there is no ``redis-server`` on PATH (Debian's package).
    :raises ServerFailed: it did not accept connections within ``start_timeout``.
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
        try:
            async with asyncio.timeout(start_timeout):
                while not await _accepts(port):
                    if process.returncode is not None:
                        raise ServerFailed(f"redis-server exited with {process.returncode}")
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise ServerFailed(f"redis-server did not listen on port {port}") from None
        yield f"redis://127.0.0.1:{port}"
    finally:
        await _stop(process, signal.SIGTERM)


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True
