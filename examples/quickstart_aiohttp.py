"""The README's aiohttp quick start: tether between a route and a batching engine.

Run: ``python examples/quickstart_aiohttp.py``, then
``curl -N 127.0.0.1:8080/generate -d '{"text": "hi", "stream": true}'``.
"""

from collections.abc import AsyncIterator

from aiohttp import web
from engine import Engine, merge_outputs  # the simulated batching engine beside this file

import tether
import tether_aiohttp

engine = Engine()
registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    stream = registry.open()  # register first: from here on no output can be lost
    engine.submit(stream.rid, body["text"], body.get("max_tokens", 16))
    return await tether_aiohttp.respond(request, stream, streaming=body.get("stream", False))


async def run_engine(app: web.Application) -> AsyncIterator[None]:
    async with engine.running(registry):
        yield


app = web.Application()
tether_aiohttp.setup(app, registry)
app.cleanup_ctx.append(run_engine)
app.router.add_post("/generate", generate)

if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=8080)
