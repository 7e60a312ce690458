"""Fixtures for the example servers' tests: the examples directory on ``sys.path``."""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections.abc import Awaitable, Callable

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# The examples are scripts (``python examples/starlette_app.py``) that import their
# siblings as top-level modules; tests import them the same way.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


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
