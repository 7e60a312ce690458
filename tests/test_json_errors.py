"""Both adapters make the same offer for the frameworks' own errors: ``json_errors(app)``
answers an unknown route, a wrong method and a body too large with the same JSON on
Starlette (uvicorn) and aiohttp, each a real server on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import httpx
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether_aiohttp
import tether_starlette
from tests.aiohttp.conftest import start_default_server
from tests.starlette.conftest import BOUND, serve
from tether.http import ErrorResponse

LIMIT: Final = 1024
"""Bytes a body may hold on both apps."""

Shape = Callable[[Any, ErrorResponse], ErrorResponse] | None


def starlette_app(shape: Shape) -> Starlette:
    async def upload(request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > LIMIT:  # (Starlette sets no limit of its own)
                raise HTTPException(413)
        return Response(b"ok")

    app = Starlette(routes=[Route("/upload", upload, methods=["POST"])])
    tether_starlette.json_errors(app, shape=shape)
    return app


def aiohttp_app(shape: Shape) -> web.Application:
    async def upload(request: web.Request) -> web.Response:
        await request.read()  # past client_max_size: aiohttp raises its own 413
        return web.Response(body=b"ok")

    app = web.Application(client_max_size=LIMIT)
    tether_aiohttp.json_errors(app, shape=shape)
    app.router.add_post("/upload", upload)
    return app


@contextlib.asynccontextmanager
async def running(framework: str, shape: Shape = None) -> AsyncIterator[str]:
    app = starlette_app(shape) if framework == "starlette" else aiohttp_app(shape)
    async with served(app) as url:
        yield url


def install_json_errors(app: Starlette | web.Application, shape: Shape) -> None:
    if isinstance(app, Starlette):
        tether_starlette.json_errors(app, shape=shape)
    else:
        tether_aiohttp.json_errors(app, shape=shape)


@contextlib.asynccontextmanager
async def served(app: Starlette | web.Application) -> AsyncIterator[str]:
    if isinstance(app, Starlette):
        async with serve(app) as (url, _):
            yield url
        return
    runner, port = await start_default_server(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def answers(url: str) -> list[tuple[int, str | None, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=BOUND) as client:
        found = [
            await client.get("/nowhere"),
            await client.get("/upload"),
            await client.post("/upload", content=b"x" * (LIMIT + 1)),
        ]
    for answer in found:
        assert answer.headers["content-type"].startswith("application/json"), answer.text
    return [(answer.status_code, answer.headers.get("allow"), answer.json()) for answer in found]


async def test_both_adapters_answer_404_405_and_413_with_the_same_json() -> None:
    async with running("starlette") as url:
        starlette_answers = await answers(url)
    async with running("aiohttp") as url:
        aiohttp_answers = await answers(url)
    assert starlette_answers == aiohttp_answers
    (status, _, body), (_, allow, _), _ = starlette_answers
    assert (status, body) == (
        404,
        {"error": {"message": "Not Found", "type": "HTTPException", "code": 404}},
    )
    assert allow is not None
    assert "POST" in allow
    assert [code for code, _, _ in starlette_answers] == [404, 405, 413]


@pytest.mark.parametrize("framework", ["starlette", "aiohttp"])
async def test_a_shape_rewrites_each_error_with_the_request_at_hand(framework: str) -> None:
    def shape(request: Any, error: ErrorResponse) -> ErrorResponse:
        path = request.url.path if framework == "starlette" else request.path
        body = {"problem": error.body["error"]["message"], "at": path}
        return ErrorResponse(error.status, body, error.headers)

    async with running(framework, shape) as url, httpx.AsyncClient(timeout=BOUND) as client:
        missing = await client.get(f"{url}/nowhere")
        wrong = await client.get(f"{url}/upload")
    assert (missing.status_code, missing.json()) == (
        404,
        {"problem": "Not Found", "at": "/nowhere"},
    )
    assert wrong.status_code == 405
    assert "POST" in wrong.headers["allow"]  # the headers go through the shape


@pytest.mark.parametrize("framework", ["starlette", "aiohttp"])
async def test_json_errors_twice_on_one_app_is_refused_and_the_first_still_answers(
    framework: str,
) -> None:
    def first(request: Any, error: ErrorResponse) -> ErrorResponse:
        return ErrorResponse(error.status, {"shape": "first"}, error.headers)

    def second(request: Any, error: ErrorResponse) -> ErrorResponse:
        return ErrorResponse(error.status, {"shape": "second"}, error.headers)

    app = starlette_app(first) if framework == "starlette" else aiohttp_app(first)
    with pytest.raises(RuntimeError, match=f"tether_{framework}.json_errors.. was already called"):
        install_json_errors(app, second)

    async with served(app) as url, httpx.AsyncClient(timeout=BOUND) as client:
        missing = await client.get(f"{url}/nowhere")
    assert (missing.status_code, missing.json()) == (404, {"shape": "first"})
