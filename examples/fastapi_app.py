"""Example: tether on FastAPI (served by uvicorn) in front of the simulated batching engine.

The same HTTP API as ``starlette_app.py`` and ``aiohttp_app.py`` (``api.py`` and
``openai_api.py`` hold its rules), written the FastAPI way: the registry as a
dependency (``RegistryDep``), pydantic models documenting every body at ``/docs``,
streaming endpoints documented as ``text/event-stream`` (``event_stream``), FastAPI's
own errors as JSON (``add_exception_handlers``), and the completions body shaped by
``respond(..., transform=...)``. Shutdown needs nothing of its own:
``TetherMiddleware`` drains when uvicorn's shutdown begins, so ``uvicorn
fastapi_app:app`` drains too.

One departure from FastAPI habits, on purpose: the models document the bodies
(``openapi_extra``) but FastAPI does not parse them. Its parser takes ``NaN`` and lone
surrogates, which its own error handler then cannot write (a text/plain 500), and it
answers a non-JSON content type, a null field or a repeated key otherwise than the
other two servers; so every body goes through the same door (``api.load_object``)
on all three, and gets the same answer.

Run it and try it (the OpenAI client works against ``/v1``)::

    python examples/fastapi_app.py --port 8000    # or add --http h11 --loop asyncio
    curl -N 127.0.0.1:8000/generate -d '{"text": "hi", "max_tokens": 8, "stream": true}'
    curl 127.0.0.1:8000/generate -d '{"text": ["a", "b"], "max_tokens": 4}'
    curl 127.0.0.1:8000/v1/completions -d '{"model": "m", "prompt": "hi", "max_tokens": 4}'
    curl 127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
    curl 127.0.0.1:8000/metrics     # Prometheus; /stats is the same as JSON
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from types import FrameType
from typing import Any

import api
import cli
import openai_api
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

# FastAPI is Starlette underneath: the Starlette example's request-level helpers serve here.
from starlette_app import client_gone, error_shape, openai_answer, read_body, refuse_with

import tether
import tether.http
import tether.resume
from tether_starlette import TetherMiddleware, respond, resume
from tether_starlette.fastapi import RegistryDep, add_exception_handlers, event_stream


class GenerateBody(BaseModel):
    """``POST /generate``: one prompt or a batch, streamed or not."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str]
    max_tokens: int | None = api.DEFAULT_MAX_TOKENS
    stream: bool | None = False
    rid: str | list[str] | None = None
    timeout: float | None = None
    resume: bool | None = False


class MetaInfo(BaseModel):
    id: str
    finish_reason: str | None
    completion_tokens: int


class Output(BaseModel):
    """One engine output (a delta when streamed; the whole text in a JSON answer)."""

    text: str
    meta_info: MetaInfo


STREAM_OPTIONS: Any = Field(None, description='{"include_usage": true}: end with the usage')


class CompletionBody(BaseModel):
    """``POST /v1/completions``: the OpenAI completions shape (sampling options are
    accepted and ignored: the engine is deterministic; ``logprobs``, ``echo``,
    ``stop``, ``suffix``... are refused with a 400 that names them)."""

    prompt: str | list[str]
    model: str = api.MODEL
    max_tokens: int | None = api.DEFAULT_MAX_TOKENS
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, bool | None] | None = STREAM_OPTIONS
    resume: bool | None = False


class ChatBody(BaseModel):
    """``POST /v1/chat/completions``: text messages, answered by the one simulated model."""

    messages: list[dict[str, Any]] = Field(
        description='{"role": "system" | "developer" | "user" | "assistant", "content": text}'
    )
    model: str = api.MODEL
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, bool | None] | None = STREAM_OPTIONS


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a JSON body the handler reads itself."""
    content = {"application/json": {"schema": model.model_json_schema()}}
    return {"requestBody": {"required": True, "content": content}}


def create_app(service: api.Service, *, drain_timeout: float = 2.0) -> FastAPI:
    """The example application around ``service`` (its engine runs during the lifespan)."""
    page = api.page()

    @contextlib.asynccontextmanager
    async def engine_running(app: FastAPI) -> AsyncIterator[None]:
        async with service.engine.running(service.registry), service.resuming():
            yield

    app = FastAPI(title="tether example", lifespan=engine_running)
    # The one drain: the middleware starts it when uvicorn's shutdown signal arrives
    # and holds the lifespan shutdown (the engine) until it is over.
    app.add_middleware(TetherMiddleware, registry=service.registry, drain_timeout=drain_timeout)
    add_exception_handlers(app, shape=error_shape)

    @app.post(
        "/generate",
        openapi_extra=documented(GenerateBody),
        **event_stream(Output, json=Output),
    )
    async def generate(request: Request) -> Response:
        try:
            generation = api.parse_generate(await read_body(request))
            # a reconnect (Last-Event-ID, with the same body)
            resumed = await resume(request, service.resume)
            if resumed is not None:
                return resumed
            source = service.open(generation)
        except api.REFUSALS as exc:
            return refuse_with(api.rejection(exc))
        except api.ClientGone:
            return client_gone()
        resumable = service.resume if generation.resume else None
        return await respond(request, source, streaming=generation.stream, resume=resumable)

    @app.post("/generate/stop", status_code=204)
    async def stop(request: Request) -> Response:
        refusal = await service.stop(request.headers.get(tether.resume.TOKEN_HEADER, ""))
        return Response(status_code=204) if refusal is None else refuse_with(refusal)

    async def openai(request: Request, parse: Callable[[bytes], openai_api.Call]) -> Response:
        try:
            call = parse(await read_body(request))
            again = openai_api.Chunks(call, None)  # (a reconnect's chunks)
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

        def shape(results: Any) -> dict[str, Any]:
            return openai_api.body(call, results, cid)

        return openai_answer(await respond(request, source, streaming=False, transform=shape))

    @app.post("/v1/completions", openapi_extra=documented(CompletionBody), **event_stream(json={}))
    async def completions(request: Request) -> Response:
        return await openai(request, openai_api.parse_completions)

    @app.post("/v1/chat/completions", openapi_extra=documented(ChatBody), **event_stream(json={}))
    async def chat(request: Request) -> Response:
        return await openai(request, openai_api.parse_chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return openai_api.models()

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
