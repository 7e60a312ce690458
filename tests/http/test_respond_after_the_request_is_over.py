"""``respond()`` for a request that is already over (a background task the handler
left behind answers with its request object once the handler returned) is refused
at once (``RuntimeError``), and what it was given is closed: nothing is left in
flight, nothing is written on the connection, whose next request gets its own
answer."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import pytest

import tether
import tether.http
from tests._support.raw_http import connection, read_response
from tests._support.servers import ADAPTERS, serving
from tests._support.waiting import eventually

BOUND = 3.0
"""A bound on a refusal that should be at once, and on reading one answer."""

GET = b"GET /generate HTTP/1.1\r\nhost: test\r\n\r\n"


@pytest.mark.parametrize("adapter", ADAPTERS)
async def test_respond_for_a_request_that_is_over_is_refused_and_leaves_nothing_behind(
    adapter: str,
) -> None:
    registry = tether.Registry()
    requests: list[tuple[ModuleType, Any, tether.RequestScope | None]] = []

    async def endpoint(verbs: ModuleType, request: Any) -> Any:
        requests.append((verbs, request, tether.http.current_scope()))
        stream = registry.open()
        registry.deliver(stream.rid, {"n": len(requests)}, finished=True)
        return await verbs.respond(request, stream, streaming=False)

    async with (
        serving(adapter, registry, "GET", "/generate", endpoint) as url,
        connection(url) as (reader, writer),
    ):
        writer.write(GET)
        assert await read_response(reader) == (200, b'{"n":1}')
        ((verbs, request, scope),) = requests
        assert scope is not None
        await eventually(lambda: scope.ended)  # the request is over

        late = registry.open()  # a background task's, after its handler returned
        registry.deliver(late.rid, {"late": True})  # mid-generation
        outcome: object
        try:
            async with asyncio.timeout(BOUND):
                outcome = await verbs.respond(request, late, streaming=True)
        except (RuntimeError, TimeoutError) as exc:
            outcome = exc
        writer.write(GET)  # the client's next request on its connection
        answer: object
        try:
            answer = await read_response(reader)
        except (ValueError, asyncio.IncompleteReadError, TimeoutError) as exc:
            answer = exc  # (what came first was no whole answer of this request)
        left = registry.in_flight
    assert isinstance(outcome, RuntimeError), f"not refused: {outcome!r}"
    assert answer == (200, b'{"n":2}')
    assert left == 0
