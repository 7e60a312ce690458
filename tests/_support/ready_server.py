"""A uvicorn server that says when its start-up is over, for tests that run one in their loop."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn


class ReadyServer(uvicorn.Server):
    """uvicorn's server with a ``ready`` event, set once start-up is over (even if it failed)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()
