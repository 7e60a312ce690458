"""The README's Starlette quick start: tether between a route and a batching engine.

Run: ``python examples/quickstart_starlette.py``, then
``curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "stream": true}'``.
"""

import contextlib
from collections.abc import AsyncIterator

import uvicorn
from engine import Engine, merge_outputs  # the simulated batching engine beside this file
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
from tether_starlette import TetherMiddleware, lifespan, respond

engine = Engine()
registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)


async def generate(request: Request) -> Response:
    body = await request.json()
    stream = registry.open()  # register first: from here on no output can be lost
    engine.submit(stream.rid, body["text"], body.get("max_tokens", 16))
    return await respond(request, stream, streaming=body.get("stream", False))


@contextlib.asynccontextmanager
async def engine_running(app: Starlette) -> AsyncIterator[None]:
    async with engine.running(registry):
        yield


app = Starlette(
    routes=[Route("/generate", generate, methods=["POST"])],
    middleware=[Middleware(TetherMiddleware, registry=registry)],
    lifespan=lifespan(registry, inner=engine_running),  # drains tether, then stops the engine
)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=8000)
