"""Example: tether on aiohttp in front of a simulated batching engine.

The same HTTP API as ``starlette_app.py``: every endpoint registers its request
with tether before handing it to the engine and answers through
``tether_aiohttp.respond()``: one prompt or a batch, streamed as server-sent
events or returned as one JSON body. A client that goes away aborts its work in
the engine at once, although aiohttp does not cancel handlers by default.

Run it and try it::

    python examples/aiohttp_app.py --port 8001    # or add --loop uvloop
    curl -N 127.0.0.1:8001/generate -d '{"text": "hi", "max_tokens": 8, "stream": true}'
    curl 127.0.0.1:8001/generate -d '{"text": ["a", "b"], "max_tokens": 4}'
    curl 127.0.0.1:8001/v1/completions -d '{"model": "m", "prompt": "hi", "max_tokens": 4}'
    curl 127.0.0.1:8001/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
    curl 127.0.0.1:8001/metrics     # Prometheus; /stats is the same as JSON
    # and open http://127.0.0.1:8001/ in a browser
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import api
import cli
import openai_api
import workers
from aiohttp import web

import tether
import tether.http
import tether.resume
import tether_aiohttp
from tether_aiohttp import respond, resume

SERVICE: web.AppKey[api.Service] = web.AppKey("service", api.Service)
json_response = functools.partial(
    web.json_response,
    dumps=functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":")),
)
"""``web.json_response`` writing JSON as Starlette's ``JSONResponse`` does (compact, UTF-8):
the same answer, byte for byte, from every example server."""


def refuse(exc: api.BadRequest | tether.TetherError) -> web.Response:
    """The JSON error response for a request refused before anything was registered."""
    return refuse_with(api.rejection(exc))


def refuse_with(refusal: tether.http.ErrorResponse) -> web.Response:
    return json_response(refusal.body, status=refusal.status, headers=refusal.headers)


async def read_body(request: web.Request) -> bytes:
    """The request body (see ``api.read_body``); a client that leaves part-way raises
    ``api.ClientGone``, not the ``OSError`` aiohttp ends the read with (which it would
    log as an error with its traceback)."""
    chunks = request.content.iter_any()
    return await api.read_body(chunks, request.headers.get("content-length"), gone=(OSError,))


def client_gone() -> web.Response:
    """The end of a request whose client left: 499, written to nobody (aiohttp skips
    the write to a closed connection)."""
    return web.Response(status=tether.http.CLIENT_CLOSED_REQUEST)


def openai_answer(response: web.StreamResponse) -> web.StreamResponse:
    """``respond()``'s answer on an OpenAI route, an error in OpenAI's shape."""
    body = response.body if isinstance(response, web.Response) else None
    if response.status < 400 or not isinstance(body, bytes):
        return response
    items = response.headers.items()
    return refuse_with(openai_api.reshaped_answer(response.status, body, items))


def error_shape(
    request: web.Request, error: tether.http.ErrorResponse
) -> tether.http.ErrorResponse:
    """aiohttp's own errors (unknown route, wrong method) as the route words them."""
    return openai_api.for_path(request.path, error)


async def generate(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    resumed = await resume(request, service.resume)  # a reconnect (Last-Event-ID)?
    if resumed is not None:
        return resumed
    try:
        generation = api.parse_generate(await read_body(request))
        source = service.open(generation)
    except api.REFUSALS as exc:
        return refuse(exc)
    except api.ClientGone:
        return client_gone()
    resumable = service.resume if generation.resume else None
    return await respond(request, source, streaming=generation.stream, resume=resumable)


async def openai(
    request: web.Request, parse: Callable[[bytes], openai_api.Call]
) -> web.StreamResponse:
    service = request.app[SERVICE]
    try:
        call = parse(await read_body(request))
        # a reconnect (Last-Event-ID, with the same body), answered as it began
        again = openai_api.Chunks(call, None)
        resumed = await resume(request, service.resume, encoder=again)
        if resumed is not None:
            return openai_answer(resumed)
        source = service.open(call.generation)
    except api.REFUSALS as exc:
        return refuse_with(openai_api.rejection(exc))
    except api.ClientGone:
        return client_gone()
    cid = openai_api.completion_id(call, source)
    if call.generation.stream:
        chunks = openai_api.Chunks(call, cid)
        resumable = service.resume if call.generation.resume else None
        return openai_answer(
            await respond(request, source, streaming=True, encoder=chunks, resume=resumable)
        )
    response = await respond(request, source, streaming=False)
    result = response.body if isinstance(response, web.Response) else None
    if response.status != 200 or not isinstance(result, bytes):
        return openai_answer(response)
    return json_response(openai_api.body(call, json.loads(result), cid))


async def completions(request: web.Request) -> web.StreamResponse:
    return await openai(request, openai_api.parse_completions)


async def chat(request: web.Request) -> web.StreamResponse:
    return await openai(request, openai_api.parse_chat)


async def models(request: web.Request) -> web.Response:
    return json_response(openai_api.models())


async def stop(request: web.Request) -> web.Response:
    refusal = await request.app[SERVICE].stop(request.headers.get(tether.resume.TOKEN_HEADER, ""))
    return web.Response(status=204) if refusal is None else refuse_with(refusal)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[SERVICE].metrics()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def stats(request: web.Request) -> web.Response:
    return json_response(request.app[SERVICE].stats())


async def aborts(request: web.Request) -> web.Response:
    return json_response(request.app[SERVICE].aborts())


async def health(request: web.Request) -> web.Response:
    status, body = request.app[SERVICE].health()
    return json_response(body, status=status)


def create_app(service: api.Service, *, drain_timeout: float = 2.0) -> web.Application:
    """The example application around ``service`` (its engine runs while the app does)."""
    app = web.Application()
    app[SERVICE] = service
    tether_aiohttp.json_errors(app, shape=error_shape)  # 404, 405, 413 as JSON
    # setup() drains the registry on shutdown; the engine stops after, in cleanup.
    tether_aiohttp.setup(app, service.registry, drain_timeout=drain_timeout)

    async def engine_running(app: web.Application) -> AsyncIterator[None]:
        async with service.engine.running(service.registry), service.resuming():
            yield

    page = api.page()

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html")

    app.cleanup_ctx.append(engine_running)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate/stop", stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics/aborts", aborts)
    app.router.add_get("/health", health)
    app.router.add_get("/", index)
    return app


async def serve(options: cli.Options, sock: socket.socket | None = None) -> None:
    """Serve until SIGINT or SIGTERM, with aiohttp's defaults (no handler cancellation).

    Either signal stops the server cleanly: the drain runs first (``on_shutdown``),
    then aiohttp waits up to :data:`cli.SHUTDOWN_MARGIN` for the last responses
    before it cancels the handlers still running. A second signal ends the drain at once. The
    signal handlers are in place before the URL is announced, so a supervisor that
    stops the server as soon as it is up gets the same clean exit.
    """
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    service = cli.build_service(options)
    app = create_app(service, drain_timeout=options.drain_timeout)
    # aiohttp waits up to shutdown_timeout twice (for the handlers; again once it has
    # failed their request bodies) before it cancels them: half the margin each.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=cli.SHUTDOWN_MARGIN / 2)
    await runner.setup()
    try:
        site: web.BaseSite = web.TCPSite(runner, cli.HOST, options.port)
        if sock is not None:  # --workers: the socket every worker shares
            site = web.SockSite(runner, sock)
        await site.start()
        cli.announce("aiohttp", runner.addresses[0][1])
        await stop.wait()
    finally:
        await _clean_up(runner, service.registry, hurry)


async def _clean_up(runner: web.AppRunner, registry: tether.Registry, hurry: asyncio.Event) -> None:
    """``runner.cleanup()`` (the drain, then the server's shutdown), the drain cut
    short when ``hurry`` is set."""
    cleanup = asyncio.create_task(runner.cleanup(), name="aiohttp-cleanup")
    hurried = asyncio.create_task(hurry.wait(), name="second-signal")
    try:
        await asyncio.wait([cleanup, hurried], return_when=asyncio.FIRST_COMPLETED)
        if not cleanup.done():
            await registry.close(drain_timeout=0)  # the drain in cleanup() returns too
        await cleanup
    finally:
        for task in (hurried, cleanup):
            task.cancel()  # (nothing, for one already done)
        await asyncio.wait([hurried, cleanup])


def main(argv: Sequence[str] | None = None) -> None:
    """Run the example server in the foreground until Ctrl-C or SIGTERM (exit code 0)."""
    options = cli.parse(argv, "tether example server on aiohttp", uvicorn=False)
    cli.configure_logging(logging.WARNING)
    sock = None
    if options.workers > 1:
        sock = workers.listen(cli.HOST, options.port, options.workers)  # (returns in each)
    with asyncio.Runner(loop_factory=cli.loop_factory(options.loop)) as runner:
        runner.run(serve(options, sock))


if __name__ == "__main__":
    main(sys.argv[1:])
