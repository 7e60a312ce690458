"""A FastAPI app using TetherMiddleware and respond() through dependency injection."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import Response
from httpx_sse import aconnect_sse
from pydantic import BaseModel
from starlette.middleware.base import RequestResponseEndpoint
from starlette.requests import Request

import tether
from tests._support.raw_http import connection, request
from tether_starlette import TetherMiddleware, get_registry, respond

from .conftest import BOUND, HANG, Engine, leave_until_aborted, serve


class Completion(BaseModel):
    prompt: str
    stream: bool = False
    hang: bool = False  # the engine never finishes (for disconnect tests)


def make_fastapi_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=engine.registry)

    @app.post("/v1/completions")
    async def complete(
        body: Completion,
        request: Request,
        registry: Annotated[tether.Registry, Depends(get_registry)],
    ) -> Response:
        stream = registry.open()
        engine.script = [{"token": word} for word in body.prompt.split()]
        if body.hang:
            engine.script.append(HANG)
        engine.submit(stream)
        return await respond(request, stream, streaming=body.stream)

    return app


async def test_fastapi_json_and_sse_answers(engine: Engine) -> None:
    app = make_fastapi_app(engine)
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(f"{url}/v1/completions", json={"prompt": "a b"})
        payload = {"prompt": "a b c", "stream": True}
        async with (
            aconnect_sse(client, "POST", f"{url}/v1/completions", json=payload) as source,
            contextlib.aclosing(source.aiter_sse()) as events,
        ):
            streamed = [event.data async for event in events]

    assert answer.json() == {"token": "b"}
    assert streamed == ['{"token":"a"}', '{"token":"b"}', '{"token":"c"}', "[DONE]"]
    assert engine.registry.in_flight == 0


async def test_fastapi_maps_an_overloaded_registry_to_503() -> None:
    engine = Engine(max_in_flight=1)
    held = engine.registry.open()
    async with (
        serve(make_fastapi_app(engine)) as (url, _),
        httpx.AsyncClient(timeout=BOUND) as client,
    ):
        response = await client.post(f"{url}/v1/completions", json={"prompt": "a"})
    await held.aclose()

    assert response.status_code == 503
    assert response.json()["error"]["type"] == "Overloaded"


async def test_fastapi_client_disconnect_mid_stream_aborts_the_work(engine: Engine) -> None:
    async with (
        serve(make_fastapi_app(engine)) as (url, _),
        httpx.AsyncClient(timeout=BOUND) as client,
    ):
        payload = {"prompt": "a", "stream": True, "hang": True}
        async with aconnect_sse(client, "POST", f"{url}/v1/completions", json=payload) as source:
            async with contextlib.aclosing(source.aiter_sse()) as events:
                first = await anext(events)
            left_at = time.perf_counter()
        await engine.until(lambda: len(engine.aborted_at) == 1)

    assert first.data == '{"token":"a"}'
    assert engine.aborted_at[engine.submitted[0]] - left_at < 0.1
    assert engine.registry.in_flight == 0
    assert engine.registry.stats().aborted == {"client_disconnected": 1}


async def _timed(request: Request, call_next: RequestResponseEndpoint) -> Response:
    """The usual ``@app.middleware("http")``: a header on every answer."""
    response = await call_next(request)
    response.headers["x-timed"] = "1"
    return response


@pytest.mark.parametrize("streaming", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("tether_side", ["outside", "inside"])
async def test_a_fastapi_http_middleware_on_either_side_of_tether_lets_a_leaver_abort_its_work(
    engine: Engine, tether_side: str, streaming: bool
) -> None:
    """``@app.middleware("http")`` decorated before ``add_middleware(TetherMiddleware)``
    runs inside it (tether reads the server's own ``receive``), decorated after it runs
    outside (tether reads the middleware's wrapper): either way a client that leaves
    during the wait is noticed."""
    app = FastAPI()
    if tether_side == "outside":
        app.middleware("http")(_timed)
    app.add_middleware(TetherMiddleware, registry=engine.registry)
    if tether_side == "inside":
        app.middleware("http")(_timed)

    @app.post("/v1/completions")
    async def complete(body: Completion, request: Request) -> Response:
        stream = engine.registry.open()
        engine.submit(stream)
        return await respond(request, stream, streaming=body.stream)

    engine.script = None
    payload = b'{"prompt": "a", "stream": %s}' % (b"true" if streaming else b"false")
    async with serve(app) as (url, _), connection(url) as (_, writer):
        writer.write(request("POST", "/v1/completions", payload, json=True))
        await engine.until(lambda: len(engine.submitted) == 1)
        rid = engine.submitted[0]
        left_at = await leave_until_aborted(engine, writer, rid)

    assert engine.aborted_at[rid] - left_at < 0.1
    assert engine.registry.stats().aborted == {"client_disconnected": 1}
