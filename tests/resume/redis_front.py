"""A front worker for the cross-worker tests: a Starlette app on uvicorn or an aiohttp
app, with resumption stored in Redis, and its own producer.

``python -m tests.resume.redis_front --adapter starlette --redis redis://127.0.0.1:PORT``
prints ``listening on http://127.0.0.1:PORT`` once it serves, and stops when its
standard input closes. Routes: ``GET /gen?n=&every=``
(a reconnect is resumed, anything else starts a stream of ``n`` outputs ``{"n": i}``,
one every ``every`` seconds), ``POST /stop`` (Stop by the ``Tether-Resume-Token``
header), ``GET /books`` (``on_abort`` calls, requests in flight, rids opened).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import socket
import sys
from typing import Any

import uvicorn
from aiohttp import web
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tether_redis import RedisStore

import tether
import tether.resume
import tether_aiohttp
import tether_starlette
from tests._support.ready_server import ReadyServer
from tether.resume import TOKEN_HEADER

PING = 0.05


class Front:
    """The registry, its producer tasks and the books of one worker."""

    def __init__(self, store: RedisStore, grace: float, max_events: int) -> None:
        self.aborts: collections.Counter[str] = collections.Counter()
        self.opened: list[str] = []
        self.registry = tether.Registry(self.on_abort)
        self.resume = tether.resume.Resume(grace=grace, max_events=max_events, store=store)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.tags: dict[str, str] = {}  # the client's tag of each rid (``?tag=``)

    def on_abort(self, rid: str) -> None:
        self.aborts[rid] += 1
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    def start(self, query: Any) -> tether.Stream:
        stream = self.registry.open()
        self.opened.append(stream.rid)
        count, every = int(query.get("n", "10")), float(query.get("every", "0.01"))
        tag = query.get("tag")
        if tag is not None:
            self.tags[stream.rid] = tag
        task = asyncio.create_task(self.produce(stream.rid, count, every, tag))
        self.tasks[stream.rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(stream.rid, None))
        return stream

    async def produce(self, rid: str, count: int, every: float, tag: str | None) -> None:
        for n in range(count):
            await asyncio.sleep(every)
            output = {"n": n} if tag is None else {"n": n, "tag": tag}
            self.registry.deliver(rid, output, finished=n == count - 1)

    def books(self) -> dict[str, Any]:
        return {
            "aborts": dict(self.aborts),
            "in_flight": self.registry.in_flight,
            "opened": self.opened,
            "resumable": len(self.resume.store),  # type: ignore[arg-type]
            "tags": self.tags,
        }

    async def close(self) -> None:
        await self.registry.close(drain_timeout=0)
        await self.resume.aclose()
        for task in list(self.tasks.values()):
            task.cancel()


def starlette_app(front: Front) -> Starlette:
    async def gen(request: Request) -> Response:
        resumed = await tether_starlette.resume(request, front.resume, ping_interval=PING)
        if resumed is not None:
            return resumed
        stream = front.start(request.query_params)
        return await tether_starlette.respond(
            request, stream, streaming=True, resume=front.resume, ping_interval=PING
        )

    async def stop(request: Request) -> Response:
        token = request.headers.get(TOKEN_HEADER, "")
        try:
            stopped = await front.resume.cancel(token)
        except ConnectionError:
            return Response(status_code=503, headers={"retry-after": "1"})
        return Response(status_code=204 if stopped else 404)

    async def books(request: Request) -> Response:
        return JSONResponse(front.books())

    return Starlette(
        routes=[Route("/gen", gen), Route("/stop", stop, methods=["POST"]), Route("/books", books)],
        middleware=[Middleware(tether_starlette.TetherMiddleware, registry=front.registry)],
    )


def aiohttp_app(front: Front) -> web.Application:
    async def gen(request: web.Request) -> web.StreamResponse:
        resumed = await tether_aiohttp.resume(request, front.resume, ping_interval=PING)
        if resumed is not None:
            return resumed
        stream = front.start(request.query)
        return await tether_aiohttp.respond(
            request, stream, streaming=True, resume=front.resume, ping_interval=PING
        )

    async def stop(request: web.Request) -> web.StreamResponse:
        token = request.headers.get(TOKEN_HEADER, "")
        try:
            stopped = await front.resume.cancel(token)
        except ConnectionError:
            return web.Response(status=503, headers={"retry-after": "1"})
        return web.Response(status=204 if stopped else 404)

    async def books(request: web.Request) -> web.StreamResponse:
        return web.json_response(front.books())

    app = web.Application()
    tether_aiohttp.setup(app, front.registry)
    app.router.add_get("/gen", gen)
    app.router.add_post("/stop", stop)
    app.router.add_get("/books", books)
    return app


async def main(options: argparse.Namespace) -> None:
    client = Redis.from_url(options.redis)
    store = RedisStore(client, block=0.2, timeout=options.timeout)
    front = Front(store, options.grace, options.max_events)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        if options.adapter == "starlette":
            config = uvicorn.Config(starlette_app(front), log_config=None, lifespan="off")
            server = ReadyServer(config)
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            await server.ready.wait()
            print(f"listening on {url}", flush=True)
            await stdin.read()
            await front.close()
            server.should_exit = True
            await serving
        else:
            runner = web.AppRunner(aiohttp_app(front), access_log=None)
            await runner.setup()
            await web.SockSite(runner, sock).start()
            print(f"listening on {url}", flush=True)
            await stdin.read()
            await front.close()
            await runner.cleanup()
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", choices=("starlette", "aiohttp"), required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--max-events", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=5.0)  # (a loaded test machine)
    asyncio.run(main(parser.parse_args()))
