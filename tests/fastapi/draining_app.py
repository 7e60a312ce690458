"""A FastAPI app with only tether's middleware installed (no lifespan helper, no
server subclass), served from the command line by the shutdown tests:
``uvicorn draining_app:app``, ``hypercorn draining_app:app``, gunicorn's uvicorn
workers. The suite's fake engine (``tests/_support/engine.py``, importable from the
repository's root) sends a token every 20 ms until a request has its
``max_tokens``; ``GET /in_flight`` tells the test when its requests are running.

``TETHER_DRAIN_TIMEOUT`` (seconds) sets the middleware's drain timeout.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

import tether
from tests._support.engine import Engine, Pause
from tether_starlette import TetherMiddleware, get_registry, respond

STEP = 0.02
"""Seconds between two tokens of every request."""


def countdown(max_tokens: int) -> Iterator[object]:
    """The engine's script for one request: a token every :data:`STEP`, counting down."""
    for left in range(max_tokens, 0, -1):
        yield Pause(STEP)  # the producer's own pace, not a synchronisation
        yield {"text": f"tok{left}"}


engine = Engine()


@contextlib.asynccontextmanager
async def run_producer(app: FastAPI) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await engine.stop()  # the engine's jobs are the app's to end


app = FastAPI(lifespan=run_producer)
app.add_middleware(
    TetherMiddleware,
    registry=engine.registry,
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
    engine.submit(stream, countdown(body.max_tokens))
    return await respond(request, stream, streaming=body.stream)


@app.get("/in_flight")
async def in_flight(registry: Annotated[tether.Registry, Depends(get_registry)]) -> int:
    return registry.in_flight
