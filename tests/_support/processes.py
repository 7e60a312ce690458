"""Stopping a subprocess the test started: a signal, a bounded wait, then SIGKILL."""

from __future__ import annotations

import asyncio
import signal


async def stop(
    process: asyncio.subprocess.Process,
    sig: signal.Signals | None = signal.SIGTERM,
    *,
    grace: float = 10.0,
) -> int:
    """Send ``sig`` to ``process`` if it still runs (``None``: send nothing, the caller
    has told it to stop another way), wait ``grace`` seconds, then kill it.

    :returns: its exit code.
    """
    if sig is not None and process.returncode is None:
        process.send_signal(sig)
    try:
        async with asyncio.timeout(grace):
            return await process.wait()
    except TimeoutError:
        process.kill()
        return await process.wait()
