"""The README's Starlette quick start: tether between a route and a batching engine.

Run: ``python examples/quickstart_starlette.py``, then
``curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "stream": true}'``.
"""

import contextlib
from collections.abc import AsyncIterator

import uvicorn
from engine import Engine, merge_outputs  # the simulated batching engine beside this file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

import tether
import tether_starlette

engine = Engine()
registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)


async def generate(request: Request) -> Response:
    body = await request.json()
    stream = registry.open()  # register first: from here on no output can be lost
    engine.submit(stream.rid, body["text"], body.get("max_tokens", 16))
    return await tether_starlette.respond(request, stream, streaming=body.get("stream", False))


@contextlib.asynccontextmanager
async def run_engine(app: Starlette) -> AsyncIterator[None]:
    async with engine.running(registry):
        yield


app = Starlette(lifespan=tether_starlette.lifespan(registry, inner=run_engine))
app.add_middleware(tether_starlette.TetherMiddleware, registry=registry)
app.add_route("/generate", generate, methods=["POST"])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=8000)
