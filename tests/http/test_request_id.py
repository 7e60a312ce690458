"""Request ids on both adapters, on real servers: a client's acceptable
``X-Request-Id`` labels its requests (observers, logs) and is echoed on the
response, streamed or not, error or not; an unacceptable one is ignored; tether's
own rid stays the server's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import aiohttp
import pytest

import tether
import tether.http
from tests._support.observers import Recorder
from tests._support.servers import ADAPTERS, serving
from tests._support.waiting import eventually

pytestmark = pytest.mark.parametrize("name", ADAPTERS)

HEADER = tether.http.REQUEST_ID_HEADER


async def generate(verbs: ModuleType, request: Any) -> Any:
    """``POST /generate``: ``max_tokens`` outputs for ``text`` (a list: a batch),
    streamed when ``stream``; a ``text`` of another type is refused (422)."""
    body = await request.json()
    text, registry = body["text"], verbs.get_registry(request)
    if not isinstance(text, str | list):
        raise tether.InvalidRequest(f"text must be a string or a list, not {text!r}")
    source = registry.open_batch(len(text)) if isinstance(text, list) else registry.open()
    rids = source.rids if isinstance(source, tether.Batch) else (source.rid,)
    for rid in rids:
        for n in range(body["max_tokens"]):
            registry.deliver(rid, {"text": f"{n}"}, finished=n == body["max_tokens"] - 1)
    return await verbs.respond(request, source, streaming=body.get("stream", False))


@contextlib.asynccontextmanager
async def running(name: str, registry: tether.Registry) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of ``/generate`` served by adapter ``name``; on exit, every request
    has ended."""
    async with (
        serving(name, registry, "POST", "/generate", generate) as url,
        aiohttp.ClientSession(url) as http,
    ):
        yield http
        await eventually(lambda: registry.in_flight == 0)


async def post(
    http: aiohttp.ClientSession, body: dict[str, Any], request_id: str | None
) -> tuple[int, str | None]:
    headers = {} if request_id is None else {HEADER: request_id}
    async with asyncio.timeout(10), http.post("/generate", json=body, headers=headers) as response:
        await response.read()
        return response.status, response.headers.get(HEADER)


async def test_an_acceptable_request_id_is_echoed_and_labels_the_request(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tether.requests")
    registry = tether.Registry()
    seen = Recorder()
    registry.add_observer(seen)
    async with running(name, registry) as http:
        small = {"text": "hi", "max_tokens": 2}
        assert await post(http, small, "json-1") == (200, "json-1")
        assert await post(http, {**small, "stream": True}, "sse-1") == (200, "sse-1")
        assert await post(http, {**small, "text": ["a", "b"]}, "batch-1") == (200, "batch-1")
        assert await post(http, {"text": 3}, "bad-1") == (422, "bad-1")  # refused: echoed too
        assert await post(http, small, None) == (200, None)  # none given, none invented
    labels = sorted(end.request_id or "-" for end in seen.ends.values())
    assert labels == ["-", "batch-1", "batch-1", "json-1", "sse-1"]
    assert not {end.rid for end in seen.ends.values()} & {"json-1", "sse-1", "batch-1"}
    logged = [r.getMessage() for r in caplog.records if r.name == "tether.requests"]
    assert sum("request_id=json-1 outcome=finished" in line for line in logged) == 1


@pytest.mark.parametrize(
    "offered",
    [
        pytest.param("x" * (tether.http.MAX_REQUEST_ID_LENGTH + 1), id="too-long"),
        pytest.param("tab\there", id="control-character"),
        pytest.param("   ", id="blank"),
    ],
)
async def test_an_unacceptable_request_id_is_ignored(name: str, offered: str) -> None:
    registry = tether.Registry()
    seen = Recorder()
    registry.add_observer(seen)
    async with running(name, registry) as http:
        assert await post(http, {"text": "hi", "max_tokens": 2}, offered) == (200, None)
    assert [end.request_id for end in seen.ends.values()] == [None]


async def test_a_request_id_never_becomes_the_rid_even_when_it_names_a_live_one(
    name: str,
) -> None:
    registry = tether.Registry()
    async with running(name, registry) as http:
        victim = registry.open()  # a live request of another client
        status, echoed = await post(http, {"text": "hi", "max_tokens": 2}, victim.rid)
        assert (status, echoed) == (200, victim.rid)
        assert victim.rid in registry  # untouched
        await victim.aclose()


def test_accept_request_id_takes_printable_ascii_only(name: str) -> None:
    accept = tether.http.accept_request_id
    assert accept(" abc-123 ") == "abc-123"
    assert accept(b"abc") == "abc"
    assert accept("é") is None
    assert accept(b"\xff") is None
    assert accept("a\r\nSet-Cookie: x") is None
    assert accept(None) is None
