"""Same inputs, same answers: every case runs against both adapters, on real servers
(uvicorn, aiohttp's own) on 127.0.0.1, and the two answers are compared."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any, Final

import httpx
import pytest

import tether
import tether_starlette
from tests._support.servers import serving
from tether.http import REQUEST_ID_HEADER

BOUND: Final = 10.0
ADAPTERS: Final = ("starlette", "aiohttp")


class App:
    """The same endpoints on either adapter: ``handle(name, respond, request)`` for each."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()
        self.registry = tether.Registry(on_abort=self._on_abort)

    def _on_abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.abort_seen.set()

    async def handle(self, name: str, respond: Callable[..., Awaitable[Any]], request: Any) -> Any:
        registry = self.registry
        stream = registry.open("r1")
        if name == "raises":
            raise ValueError("a bug in the handler, after open()")
        if name == "overloaded":
            stream.cancel()
            raise tether.Overloaded(2)
        if name == "json":
            registry.deliver(stream.rid, {"n": 1}, finished=True)
            return await respond(request, stream, streaming=False)
        if name == "transform":
            registry.deliver(stream.rid, {"n": 1}, finished=True)
            return await respond(request, stream, streaming=False, transform=lambda r: [r])
        if name == "transform-stream":
            registry.deliver(stream.rid, {"n": 1})
            registry.deliver(stream.rid, {"n": 2}, finished=True)
            return await respond(request, stream, streaming=True, transform=lambda o: o["n"])
        if name == "fails-first":
            registry.fail(stream.rid, RuntimeError("secret detail"))
            return await respond(request, stream, streaming=True)
        if name == "fails-later":
            registry.deliver(stream.rid, {"n": 1})
            # (after the head took the first output: the failure is the loop's to write)
            asyncio.get_running_loop().call_soon(registry.fail, stream.rid, RuntimeError("x"))
            return await respond(request, stream, streaming=True)
        assert name == "hangs"
        registry.deliver(stream.rid, {"n": 1})
        return await respond(request, stream, streaming=True)


NAMES: Final = (
    "raises",
    "overloaded",
    "json",
    "transform",
    "transform-stream",
    "fails-first",
    "fails-later",
    "hangs",
)


@contextlib.asynccontextmanager
async def served(adapter: str, app: App) -> AsyncIterator[str]:
    """``app`` on a real server of ``adapter`` on 127.0.0.1; yields its base URL."""

    async def endpoint(module: ModuleType, request: Any) -> Any:
        starlette = module is tether_starlette
        name = request.path_params["name"] if starlette else request.match_info["name"]
        return await app.handle(name, module.respond, request)

    async with serving(adapter, app.registry, "GET", "/{name}", endpoint) as url:
        yield url


def _seen(response: httpx.Response) -> dict[str, Any]:
    """What is compared of an answer: its status, the headers of interest, its body."""
    content_type = response.headers.get("content-type", "")
    body: Any = response.content
    if content_type == "application/json":
        body = response.json()
    return {
        "status": response.status_code,
        "content-type": content_type,
        "request-id": response.headers.get(REQUEST_ID_HEADER),
        "retry-after": response.headers.get("retry-after"),
        "body": body,
    }


async def _answers(path: str, headers: dict[str, str]) -> dict[str, dict[str, Any]]:
    answers = {}
    for adapter in ADAPTERS:
        app = App()
        async with served(adapter, app) as url, httpx.AsyncClient(timeout=BOUND) as client:
            response = await client.get(url + path, headers=headers)
        assert app.registry.in_flight == 0, adapter
        answers[adapter] = _seen(response)
    return answers


SSE: Final = "text/event-stream; charset=utf-8"
ERROR_500: Final = {
    "message": "request 'r1' failed in the producer",
    "type": "ProducerError",
    "code": 500,
}

CASES: Final[dict[str, tuple[str, dict[str, str], dict[str, Any]]]] = {
    "raising-handler": ("/raises", {REQUEST_ID_HEADER: "job-7"}, {"status": 500}),
    "request-id-too-long": (
        "/json",
        {REQUEST_ID_HEADER: "x" * 1000},
        {"status": 200, "request-id": None, "body": {"n": 1}},
    ),
    "tether-error-before-start": (
        "/overloaded",
        {REQUEST_ID_HEADER: "job-8"},
        {"status": 503, "request-id": "job-8", "retry-after": "1"},
    ),
    "transform-json": ("/transform", {}, {"status": 200, "body": [{"n": 1}]}),
    "transform-stream": (
        "/transform-stream",
        {},
        {"status": 200, "content-type": SSE, "body": b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"},
    ),
    "error-before-first-output": (
        "/fails-first",
        {},
        {"status": 500, "content-type": "application/json", "body": {"error": ERROR_500}},
    ),
    "error-after-first-output": (
        "/fails-later",
        {},
        {
            "status": 200,
            "content-type": SSE,
            "body": b'data: {"n":1}\n\ndata: {"error":'
            + json.dumps(ERROR_500, separators=(",", ":")).encode()
            + b"}\n\ndata: [DONE]\n\n",
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_both_adapters_answer_the_same_input_the_same_way(case: str) -> None:
    path, headers, expected = CASES[case]
    answers = await _answers(path, headers)
    assert answers["starlette"]["status"] == answers["aiohttp"]["status"]
    assert answers["starlette"]["request-id"] == answers["aiohttp"]["request-id"]
    if case != "raising-handler":  # (the body of an escaped error is the framework's)
        assert answers["starlette"] == answers["aiohttp"]
    for adapter, seen in answers.items():
        assert {key: seen[key] for key in expected} == expected, adapter
    if case == "raising-handler":
        assert answers["starlette"]["request-id"] == "job-7"


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_a_client_that_leaves_mid_stream_aborts_its_work_on_both_adapters(
    adapter: str,
) -> None:
    app = App()
    async with served(adapter, app) as url, httpx.AsyncClient(timeout=BOUND) as client:
        async with asyncio.timeout(BOUND):
            async with client.stream("GET", url + "/hangs") as response:
                assert response.status_code == 200
                async for chunk in response.aiter_bytes():
                    assert chunk.startswith(b'data: {"n":1}')
                    break
            await app.abort_seen.wait()  # the client closed: the work is aborted
    assert len(app.aborted) == 1
    assert app.registry.in_flight == 0
