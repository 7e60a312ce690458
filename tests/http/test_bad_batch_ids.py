"""Review: a client's bad batch of ids gets a text/plain 500 and a traceback.

The core refuses a client-chosen id that is not an id with :class:`tether.InvalidRequestId`
(a ``TetherError``: both adapters answer 422 with a JSON body), but refuses a batch
that names the same id twice, or names none, with a plain ``ValueError``, which
neither adapter maps: the client gets a text/plain 500 and the server logs
"Exception in ASGI application" / "Error handling request". Ids of a batch come from
the client exactly as a single id does (the example API had to check this itself).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import tether
import tether_aiohttp
import tether_starlette
from tests.aiohttp.conftest import start_default_server
from tests.starlette.conftest import serve

BAD_BATCHES = [["x", "x"], []]
IDS = ["the-same-id-twice", "no-id"]


def _finish_all(registry: tether.Registry, batch: tether.Batch) -> None:
    for rid in batch.rids:
        registry.deliver(rid, rid, finished=True)


async def _post(url: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url, json=body)


def _assert_clear_client_error(response: httpx.Response, registry: tether.Registry) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert "error" in response.json()
    assert registry.in_flight == 0


@pytest.mark.parametrize("rids", BAD_BATCHES, ids=IDS)
async def test_starlette_answers_a_bad_batch_of_client_ids_with_a_4xx_json_error(
    rids: list[str],
) -> None:
    registry = tether.Registry()

    async def endpoint(request: Request) -> Response:
        batch = tether_starlette.get_registry(request).open_batch((await request.json())["rids"])
        _finish_all(registry, batch)
        return await tether_starlette.respond(request, batch, streaming=False)

    app = Starlette(routes=[Route("/batch", endpoint, methods=["POST"])])
    app.add_middleware(tether_starlette.TetherMiddleware, registry=registry)
    async with serve(app) as (url, _server):
        response = await _post(f"{url}/batch", {"rids": rids})
    _assert_clear_client_error(response, registry)


@pytest.mark.parametrize("rids", BAD_BATCHES, ids=IDS)
async def test_aiohttp_answers_a_bad_batch_of_client_ids_with_a_4xx_json_error(
    rids: list[str],
) -> None:
    registry = tether.Registry()

    async def endpoint(request: web.Request) -> web.StreamResponse:
        batch = tether_aiohttp.get_registry(request).open_batch((await request.json())["rids"])
        _finish_all(registry, batch)
        return await tether_aiohttp.respond(request, batch, streaming=False)

    app = web.Application()
    tether_aiohttp.setup(app, registry)
    app.router.add_post("/batch", endpoint)
    runner, port = await start_default_server(app)
    try:
        async with asyncio.timeout(10):
            response = await _post(f"http://127.0.0.1:{port}/batch", {"rids": rids})
    finally:
        await runner.cleanup()
    _assert_clear_client_error(response, registry)
