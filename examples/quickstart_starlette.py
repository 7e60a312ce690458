"""The README's Starlette quick start: tether between a route and a producer of its own.

Run: ``python examples/quickstart_starlette.py``, then
``curl -N 127.0.0.1:8000/generate -d '{"text": "hello tether world", "stream": true}'``.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

import tether
import tether_starlette


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


@contextlib.asynccontextmanager
async def run_producer(app: Starlette) -> AsyncIterator[None]:
    task = asyncio.create_task(producer.run(registry))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])


producer = Producer()
registry = tether.Registry(on_abort=producer.abort, merge=join)


async def generate(request: Request) -> Response:
    body = await request.json()
    stream = registry.open()  # register first: from here on no output can be lost
    producer.submit(stream.rid, body["text"])
    return await tether_starlette.respond(request, stream, streaming=body.get("stream", False))


app = Starlette(lifespan=tether_starlette.lifespan(registry, inner=run_producer))
app.add_middleware(tether_starlette.TetherMiddleware, registry=registry)
app.add_route("/generate", generate, methods=["POST"])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=8000)
