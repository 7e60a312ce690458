"""Example: tether on FastAPI (served by uvicorn) in front of the simulated batching engine.

The same HTTP API as ``starlette_app.py`` and ``aiohttp_app.py`` (``api.py`` holds
its rules), written the FastAPI way: pydantic request models (validated by FastAPI,
documented at ``/docs``), the registry as a dependency (``RegistryDep``), FastAPI's
own errors in tether's error shape (``add_exception_handlers``), and the
completions body shaped by ``respond(..., transform=...)``. Shutdown needs nothing
of its own: ``TetherMiddleware`` drains when uvicorn's shutdown begins, so
``uvicorn fastapi_app:app`` drains too.

Run it and try it (the OpenAI client works against ``/v1``)::

    python examples/fastapi_app.py --port 8000    # or add --http h11 --loop asyncio
    curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "max_tokens": 8, "stream": true}'
    curl 127.0.0.1:8000/generate -d '{"text": ["a", "b"], "max_tokens": 4}'
    curl 127.0.0.1:8000/v1/completions -d '{"model": "m", "prompt": "hi", "max_tokens": 4}'
    curl 127.0.0.1:8000/metrics     # Prometheus; /stats is the same as JSON
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from types import FrameType
from typing import Any

import api
import cli
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.requests import ClientDisconnect

import tether
import tether.http
import tether.resume
from tether_starlette import TetherMiddleware, lifespan, respond, resume
from tether_starlette.fastapi import (
    RegistryDep,
    add_exception_handlers,
    validation_exception_handler,
)


class GenerateBody(BaseModel):
    """``POST /generate``: one prompt or a batch, streamed or not."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str]
    max_tokens: int = api.DEFAULT_MAX_TOKENS
    stream: bool = False
    rid: str | list[str] | None = None
    timeout: float | None = None
    resume: bool = False


class CompletionBody(BaseModel):
    """``POST /v1/completions``: the OpenAI completions shape (sampling options are
    accepted and ignored: the engine is deterministic)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | list[str]
    model: str = api.MODEL
    max_tokens: int = api.DEFAULT_MAX_TOKENS
    stream: bool = False
    resume: bool = False


def refuse(exc: api.BadRequest | tether.TetherError) -> JSONResponse:
    """The JSON error response for a request refused before anything was registered."""
    refusal = api.rejection(exc)
    return JSONResponse(refusal.body, refusal.status, headers=refusal.headers)


async def read_body(request: Request) -> bytes:
    """The body FastAPI read for the model, through ``api.read_body`` (413 past the
    limit, as on the other servers); a client that left part-way is ``ClientGone``."""
    chunks = request.stream()  # (the bytes FastAPI kept, or the rest of the body)
    return await api.read_body(
        chunks, request.headers.get("content-length"), gone=(ClientDisconnect,)
    )


async def invalid(request: Request, exc: Exception) -> Response:
    """FastAPI's validation errors in tether's shape; a body that is not JSON at all
    is a 400, as on the other servers."""
    if isinstance(exc, RequestValidationError) and any(
        error.get("type") == "json_invalid" for error in exc.errors()
    ):
        return refuse(api.BadRequest(400, "the request body is not valid JSON"))
    return await validation_exception_handler(request, exc)


def create_app(service: api.Service, *, drain_timeout: float = 2.0) -> FastAPI:
    """The example application around ``service`` (its engine runs during the lifespan)."""
    page = api.page()

    @contextlib.asynccontextmanager
    async def engine_running(app: FastAPI) -> AsyncIterator[None]:
        async with service.engine.running(service.registry), service.resuming():
            yield

    app = FastAPI(
        title="tether example",
        lifespan=lifespan(service.registry, drain_timeout=drain_timeout, inner=engine_running),
    )
    app.add_middleware(TetherMiddleware, registry=service.registry, drain_timeout=drain_timeout)
    add_exception_handlers(app)
    app.add_exception_handler(RequestValidationError, invalid)

    # The models give the shape (FastAPI validates it, /docs shows it); api.py's
    # parsers then apply the rules all three servers share (limits, ids, hostile
    # text) to the same bytes, which FastAPI read once and kept.

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> Response:
        try:
            generation = api.parse_generate(await read_body(request))
            # a reconnect (Last-Event-ID, with the same body: FastAPI validates it)
            resumed = await resume(request, service.resume)
            if resumed is not None:
                return resumed
            source = service.open(generation)
        except api.REFUSALS as exc:
            return refuse(exc)
        except api.ClientGone:
            return Response(status_code=tether.http.CLIENT_CLOSED_REQUEST)
        resumable = service.resume if generation.resume else None
        return await respond(request, source, streaming=generation.stream, resume=resumable)

    @app.post("/generate/stop")
    async def stop(request: Request) -> Response:
        refusal = await service.stop(request.headers.get(tether.resume.TOKEN_HEADER, ""))
        if refusal is None:
            return Response(status_code=204)
        return JSONResponse(refusal.body, refusal.status, headers=refusal.headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        try:
            generation = api.parse_completions(await read_body(request))
            again = api.CompletionChunks(None, generation.model)  # (a reconnect's chunks)
            resumed = await resume(request, service.resume, encoder=again)
            if resumed is not None:
                return resumed
            source = service.open(generation)
        except api.REFUSALS as exc:
            return refuse(exc)
        except api.ClientGone:
            return Response(status_code=tether.http.CLIENT_CLOSED_REQUEST)
        cid = api.completion_id(source)
        if generation.stream:
            encoder = api.CompletionChunks(cid, generation.model)
            resumable = service.resume if generation.resume else None
            return await respond(request, source, streaming=True, encoder=encoder, resume=resumable)

        def shape(results: Any) -> dict[str, Any]:
            return api.completion(generation, results, cid)

        return await respond(request, source, streaming=False, transform=shape)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = service.metrics()
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/stats")
    async def stats(registry: RegistryDep) -> dict[str, Any]:
        # (the registry as a handler receives it: the middleware's, by dependency)
        return {**registry.stats().as_dict(), "engine": service.engine.stats().as_dict()}

    @app.get("/metrics/aborts")
    async def aborts() -> dict[str, Any]:
        return service.aborts()

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.health()
        return JSONResponse(body, status)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    return app


class Server(uvicorn.Server):
    """Plain uvicorn, plus two things an example server wants: it prints its URL once
    listening, and exits 0 on Ctrl-C and SIGTERM alike (uvicorn raises the signal
    again once shut down). The drain is the middleware's, not this class's."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # A second Ctrl-C: the middleware ended the drain at once, but uvicorn
            # skips the lifespan shutdown, which would leave the engine to be
            # cancelled mid-step by asyncio.run (a traceback). It takes milliseconds.
            await self.lifespan.shutdown()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            port = sockets[0].getsockname()[1]
            cli.announce("fastapi", port, http=self.config.http_protocol_class)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the example server in the foreground until Ctrl-C or SIGTERM (exit code 0)."""
    options = cli.parse(argv, "tether example server on FastAPI + uvicorn")
    service = cli.build_service(options)
    app = create_app(service, drain_timeout=options.drain_timeout)
    config = cli.uvicorn_config(app, options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cli.HOST, options.port))
    Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1:])
