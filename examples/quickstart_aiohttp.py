"""The README's aiohttp quick start: tether between a route and a producer of its own.

Run: ``python examples/quickstart_aiohttp.py``, then
``curl -N 127.0.0.1:8080/generate -d '{"text": "hello tether world", "stream": true}'``.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

import tether
import tether_aiohttp


class Producer:
    """Your engine goes here: each step, it echoes one more word of every prompt."""

    def __init__(self) -> None:
        self.todo: dict[str, list[str]] = {}  # rid -> the words still to send

    def submit(self, rid: str, text: str) -> None:
        self.todo[rid] = text.split() or [""]

    def abort(self, rid: str) -> None:  # tether calls it when a request ends early
        self.todo.pop(rid, None)

    async def run(self, registry: tether.Registry) -> None:
        while True:
            await asyncio.sleep(0.05)  # one engine step
            for rid, words in list(self.todo.items()):
                word = words.pop(0)
                if not words:
                    del self.todo[rid]
                registry.deliver(rid, {"text": " " + word}, finished=not words)


def join(old: Any, new: Any) -> Any:  # what one JSON answer holds: every output, joined
    return {"text": old["text"] + new["text"]}


async def run_producer(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(producer.run(registry))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])


producer = Producer()
registry = tether.Registry(on_abort=producer.abort, merge=join)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    stream = registry.open()  # register first: from here on no output can be lost
    producer.submit(stream.rid, body["text"])
    return await tether_aiohttp.respond(request, stream, streaming=body.get("stream", False))


app = web.Application()
tether_aiohttp.setup(app, registry)
app.cleanup_ctx.append(run_producer)
app.router.add_post("/generate", generate)

if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=8080)
