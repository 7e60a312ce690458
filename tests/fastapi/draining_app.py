"""A FastAPI app with only tether's middleware installed (no lifespan helper, no
server subclass), served from the command line by the shutdown tests:
``uvicorn draining_app:app``, ``hypercorn draining_app:app``, gunicorn's uvicorn
workers. Its producer sends a token every 20 ms until a request has its
``max_tokens``; ``GET /in_flight`` tells the test when its requests are running.

``TETHER_DRAIN_TIMEOUT`` (seconds) sets the middleware's drain timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

import tether
from tether_starlette import TetherMiddleware, get_registry, respond

STEP = 0.02
"""Seconds between two tokens of every request."""


class Producer:
    """Every request in flight gets one more token each step; the loop task is owned
    by the app's lifespan."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.registry = tether.Registry(on_abort=self.abort)

    def submit(self, rid: str, max_tokens: int) -> None:
        self.left[rid] = max_tokens

    def abort(self, rid: str) -> None:
        self.left.pop(rid, None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(STEP)  # the producer's own pace, not a synchronisation
            for rid, left in list(self.left.items()):
                self.left[rid] = left - 1
                if left == 1:
                    del self.left[rid]
                self.registry.deliver(rid, {"text": f"tok{left}"}, finished=left == 1)


producer = Producer()


@contextlib.asynccontextmanager
async def run_producer(app: FastAPI) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(producer.run())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])


app = FastAPI(lifespan=run_producer)
app.add_middleware(
    TetherMiddleware,
    registry=producer.registry,
    drain_timeout=float(os.environ.get("TETHER_DRAIN_TIMEOUT", "5")),
)


class Generate(BaseModel):
    max_tokens: int = 16
    stream: bool = False


@app.post("/generate")
async def generate(
    body: Generate, request: Request, registry: Annotated[tether.Registry, Depends(get_registry)]
) -> Response:
    stream = registry.open()
    producer.submit(stream.rid, body.max_tokens)
    return await respond(request, stream, streaming=body.stream)


@app.get("/in_flight")
async def in_flight(registry: Annotated[tether.Registry, Depends(get_registry)]) -> int:
    return registry.in_flight
