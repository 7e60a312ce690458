"""The one bounded poll of the suite, for conditions that no event announces."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], *, timeout: float = 10.0
) -> None:
    """Wait until ``predicate()`` (sync or async) holds, polling every 5 ms, for states
    no event announces: another process's counters or output, a server noticing a
    closed connection, an engine's next step, a socket's state.

    :raises TimeoutError: it did not hold within ``timeout`` seconds.
    """
    async with asyncio.timeout(timeout):
        while True:
            held = predicate()
            if not isinstance(held, bool):
                held = await held
            if held:
                return
            await asyncio.sleep(0.005)
