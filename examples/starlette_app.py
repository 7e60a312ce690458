"""Example: tether on Starlette (served by uvicorn) in front of a simulated batching engine.

Every endpoint registers its request with tether before handing it to the engine
and answers through ``tether_starlette.respond()``: one prompt or a batch,
streamed as server-sent events or returned as one JSON body. A client that goes
away aborts its work in the engine at once.

Run it and try it::

    python examples/starlette_app.py --port 8000    # or add --http h11 --loop asyncio
    curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "max_tokens": 8, "stream": true}'
    curl 127.0.0.1:8000/generate -d '{"text": ["a", "b"], "max_tokens": 4}'
    curl 127.0.0.1:8000/v1/completions -d '{"model": "m", "prompt": "hi", "max_tokens": 4}'
    curl 127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
    curl 127.0.0.1:8000/metrics     # Prometheus; /stats is the same as JSON
    # and open http://127.0.0.1:8000/ in a browser
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from types import FrameType

import api
import cli
import openai_api
import uvicorn
import workers
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

import tether
import tether.http
import tether.resume
from tether.http import ErrorResponse
from tether_starlette import TetherMiddleware, json_errors, respond, resume


def refuse(exc: api.BadRequest | tether.TetherError) -> JSONResponse:
    """The JSON error response for a request refused before anything was registered."""
    return refuse_with(api.rejection(exc))


def refuse_with(refusal: tether.http.ErrorResponse) -> JSONResponse:
    return JSONResponse(refusal.body, refusal.status, headers=refusal.headers)


async def read_body(request: Request) -> bytes:
    """The request body (see ``api.read_body``); a client that leaves part-way raises
    ``api.ClientGone``, not Starlette's ``ClientDisconnect`` (which would be logged
    as a crash of the application)."""
    chunks = request.stream()
    return await api.read_body(
        chunks, request.headers.get("content-length"), gone=(ClientDisconnect,)
    )


def client_gone() -> Response:
    """The end of a request whose client left: 499 for the logs, sent to nobody
    (uvicorn drops what is sent after a disconnect)."""
    return Response(status_code=tether.http.CLIENT_CLOSED_REQUEST)


def openai_answer(response: Response) -> Response:
    """``respond()``'s answer on an OpenAI route, an error in OpenAI's shape."""
    if response.status_code < 400:
        return response
    body, items = bytes(response.body), response.headers.items()
    return refuse_with(openai_api.reshaped_answer(response.status_code, body, items))


def error_shape(request: Request, error: ErrorResponse) -> ErrorResponse:
    """Starlette's own errors (unknown route, wrong method) as the route words them."""
    return openai_api.for_path(request.url.path, error)


def create_app(service: api.Service, *, drain_timeout: float = 2.0) -> Starlette:
    """The example application around ``service`` (its engine runs during the lifespan)."""
    page = api.page()

    async def generate(request: Request) -> Response:
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

    async def openai(request: Request, parse: Callable[[bytes], openai_api.Call]) -> Response:
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
            streamed = await respond(
                request, source, streaming=True, encoder=chunks, resume=resumable
            )
            return openai_answer(streamed)
        response = await respond(request, source, streaming=False)
        if response.status_code != 200:
            return openai_answer(response)
        return JSONResponse(openai_api.body(call, json.loads(bytes(response.body)), cid))

    async def completions(request: Request) -> Response:
        return await openai(request, openai_api.parse_completions)

    async def chat(request: Request) -> Response:
        return await openai(request, openai_api.parse_chat)

    async def models(request: Request) -> Response:
        return JSONResponse(openai_api.models())

    async def stop(request: Request) -> Response:
        refusal = await service.stop(request.headers.get(tether.resume.TOKEN_HEADER, ""))
        return Response(status_code=204) if refusal is None else refuse_with(refusal)

    async def metrics(request: Request) -> Response:
        body, content_type = service.metrics()
        return Response(body, headers={"Content-Type": content_type})

    async def stats(request: Request) -> Response:
        return JSONResponse(service.stats())

    async def aborts(request: Request) -> Response:
        return JSONResponse(service.aborts())

    async def health(request: Request) -> Response:
        status, body = service.health()
        return JSONResponse(body, status)

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    @contextlib.asynccontextmanager
    async def engine_running(app: Starlette) -> AsyncIterator[None]:
        async with service.engine.running(service.registry), service.resuming():
            yield

    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/generate/stop", stop, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/stats", stats),
            Route("/metrics/aborts", aborts),
            Route("/health", health),
            Route("/", index),
        ],
        middleware=[
            # The one drain: the middleware starts it when uvicorn's shutdown signal
            # arrives and holds the lifespan shutdown (the engine) until it is over.
            Middleware(TetherMiddleware, registry=service.registry, drain_timeout=drain_timeout)
        ],
        lifespan=engine_running,
    )
    json_errors(app, shape=error_shape)  # 404 and 405 as JSON, in each route's shape
    return app


class Server(uvicorn.Server):
    """uvicorn's server, announcing its URL once listening and exiting 0 on a signal.

    The drain is ``TetherMiddleware``'s (``docs/starlette.md``): it starts when the
    shutdown signal arrives, since uvicorn waits for open connections *before* the
    lifespan shutdown runs, and ends what is left after ``drain_timeout``. uvicorn's
    own grace period (``timeout_graceful_shutdown``, past which it cancels the
    handlers still running) must outlast the drain: ``main()`` sets it to the drain
    timeout plus :data:`cli.SHUTDOWN_MARGIN` (``cli.uvicorn_config``).

    SIGINT and SIGTERM are the normal way to stop this server, and it exits with 0
    after either: uvicorn would raise the signal again once shut down (a
    ``KeyboardInterrupt`` traceback and exit code -2 for Ctrl-C, death by SIGTERM).
    A second Ctrl-C still forces the exit, ending the drain at once.
    """

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler, less the note that makes it raise the signal again.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    def cancelled_at_shutdown(self, record: logging.LogRecord) -> bool:
        """A logging filter: a handler that uvicorn cancelled at shutdown (its grace
        period over, or a forced exit) ends its response first (``respond()`` sends
        an error event and the terminal frame, if the client still reads) and then
        lets the cancellation go on, which uvicorn logs with a traceback. uvicorn
        already said it cancelled them: one line each is enough."""
        error = record.exc_info[1] if record.exc_info else None
        if self.should_exit and isinstance(error, asyncio.CancelledError):
            record.msg, record.args = "a request still running at shutdown was cancelled", ()
            record.exc_info, record.exc_text, record.levelno = None, None, logging.WARNING
            record.levelname = logging.getLevelName(logging.WARNING)
        return True

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        # Around asyncio.run() as a whole: at its end it cancels what is left.
        log = logging.getLogger("uvicorn.error")
        log.addFilter(self.cancelled_at_shutdown)
        try:
            super().run(sockets)
        finally:
            log.removeFilter(self.cancelled_at_shutdown)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            port = sockets[0].getsockname()[1]
            cli.announce("starlette", port, http=self.config.http_protocol_class)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self.force_exit:
                # A second Ctrl-C (the middleware has ended the drain at once): stop the
                # engine, which uvicorn's forced exit skips, leaving it to asyncio.run to
                # cancel mid-step (a traceback). It takes milliseconds.
                await self.lifespan.shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the example server in the foreground until Ctrl-C or SIGTERM (exit code 0)."""
    options = cli.parse(argv, "tether example server on Starlette + uvicorn")
    service = cli.build_service(options)
    app = create_app(service, drain_timeout=options.drain_timeout)
    config = cli.uvicorn_config(app, options)
    sock = workers.listen(cli.HOST, options.port, options.workers)  # (returns in each worker)
    Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
