"""``respond()`` owns its source and watches the client for it, wherever it was opened.

A client disconnect must reach a source that the request's ``RequestScope`` did
not adopt: one opened outside the handler's context (a dispatcher task that opens
streams for queued requests, a job opened by an earlier request and answered by
this one). Otherwise the producer works for nobody until it finishes.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import pytest

import tether
from tests._support.raw_http import send_then_leave
from tests._support.servers import ADAPTERS, serving


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_respond_aborts_a_source_opened_outside_any_request_when_the_client_leaves(
    adapter: str,
) -> None:
    aborted, answering = asyncio.Event(), asyncio.Event()
    registry = tether.Registry(lambda rid: aborted.set())
    jobs: list[tether.Stream] = []

    async def answer(verbs: ModuleType, request: Any) -> Any:
        answering.set()
        return await verbs.respond(request, jobs[0], streaming=False)

    async with serving(adapter, registry, "GET", "/job", answer) as url:
        jobs.append(registry.open())  # (the test itself runs in no request scope)
        try:
            request = b"GET /job HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            await send_then_leave(url, request, answering, aborted)
        finally:
            await registry.close(drain_timeout=0)
