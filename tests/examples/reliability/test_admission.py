"""Admission control on every server: beyond ``max_in_flight`` a request gets 503 with
``Retry-After`` at once, nothing is registered for it, and the server admits again
as soon as load drops."""

from __future__ import annotations

import asyncio
import collections
from typing import Final

import aiohttp
import pytest
from engine import expected_text

from .client import events, long_stream, outcome
from .harness import SERVERS, eventually, running, service

pytestmark = pytest.mark.parametrize("name", SERVERS)

LIMIT: Final = 6
AT_ONCE: Final = 2.0
"""A refusal must not wait for capacity: a generous bound on "at once" under CI load."""


async def test_beyond_max_in_flight_requests_get_503_with_retry_after_at_once_then_recover(
    name: str,
) -> None:
    async with running(name, service(step_interval=0.001, max_in_flight=LIMIT)) as server:
        ledger = server.ledger
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(server.url) as http:
            held = []
            for i in range(LIMIT):
                response = await http.post("/generate", json=long_stream(f"hold {i}"))
                assert response.status == 200
                await anext(events(response))
                held.append(response)
            assert ledger.in_flight == LIMIT
            opened = ledger.stats().opened
            for body in ({"text": "one more"}, {"text": ["a", "b"]}, long_stream("more")):
                sent = loop.time()
                async with http.post("/generate", json=body) as refused:
                    error = await refused.json()
                    assert loop.time() - sent < AT_ONCE
                    assert refused.status == 503
                    assert error["error"]["code"] == 503
                    assert int(refused.headers["Retry-After"]) >= 1
            assert ledger.stats().opened == opened  # nothing registered for them
            for response in held[:2]:  # load drops: two clients leave
                response.close()
            await eventually(lambda: ledger.in_flight == LIMIT - 2)
            status, got = await outcome(http, {"text": "in again", "max_tokens": 4})
            assert (status, got[0]["text"]) == (200, expected_text("in again", 4))
            for response in held[2:]:
                response.close()
        await server.idle()
        assert not ledger.problems()


async def test_a_burst_beyond_the_limit_gets_only_200s_and_503s_and_leaves_nothing(
    name: str,
) -> None:
    async with running(name, service(step_interval=0.001, max_in_flight=LIMIT)) as server:
        async with aiohttp.ClientSession(server.url) as http:
            bodies = [{"text": f"burst {i}", "max_tokens": 20} for i in range(60)]
            results = await asyncio.gather(*(outcome(http, body) for body in bodies))
        statuses = collections.Counter(status for status, _ in results)
        assert set(statuses) <= {200, 503}
        assert statuses[200] >= LIMIT
        assert statuses[503] > 0
        for (status, got), body in zip(results, bodies, strict=True):
            if status == 200:
                assert got[0]["text"] == expected_text(body["text"], 20)
        await server.idle()
        assert not server.ledger.problems()
