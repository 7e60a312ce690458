"""``GET /metrics`` of both example servers, on real servers: after a known sequence
of HTTP requests (finished JSON, SSE and batch; a client that leaves; a deadline; a
server abort; a producer failure), every metric scraped and parsed back has the
value that sequence implies; ``/stats`` keeps the JSON view."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import pytest

import tether
from tests._support.observers import Recorder
from tests._support.scrape import Scrape
from tests.examples.reliability.client import events, long_stream
from tests.examples.reliability.harness import running, service

pytestmark = pytest.mark.parametrize("name", ["starlette", "aiohttp"])


async def finish(http: aiohttp.ClientSession, body: dict[str, Any]) -> int:
    async with http.post("/generate", json=body) as response:
        await response.read()
        return response.status


async def first_output_then(
    http: aiohttp.ClientSession, body: dict[str, Any], then: Any
) -> list[Any]:
    """Open a long stream, wait for its first event, run ``then()``, read the rest."""
    async with http.post("/generate", json=body) as response:
        assert response.status == 200
        got = events(response)
        await anext(got)
        then()
        return [event async for event in got]


async def test_the_metrics_endpoint_counts_a_known_sequence_of_requests(name: str) -> None:
    svc = service()
    registry = svc.registry
    times = Recorder()
    registry.add_observer(times)
    async with running(name, svc) as server, aiohttp.ClientSession(server.url) as http:
        async with asyncio.timeout(10):
            assert await finish(http, {"text": "a", "max_tokens": 2}) == 200
            assert await finish(http, {"text": "b", "max_tokens": 2, "stream": True}) == 200
            assert await finish(http, {"text": ["c", "d"], "max_tokens": 2}) == 200
            timed = {"text": "e", "max_tokens": 4000, "timeout": 0.05}
            assert await finish(http, timed) == 504

            async with http.post("/generate", json=long_stream("gone")) as response:
                await anext(events(response))  # then the client leaves
            await server.idle()

            rest = await first_output_then(
                http, long_stream("f", rid="abort-me"), lambda: registry.abort("abort-me")
            )
            assert rest[-2]["error"]["type"] == "Aborted"

            def fail() -> None:
                registry.fail("fail-me", RuntimeError("the engine broke"))
                svc.engine.abort("fail-me")  # the test failed it: tell the engine to stop

            rest = await first_output_then(http, long_stream("g", rid="fail-me"), fail)
            assert rest[-1] == "[DONE]"
            await server.idle()

            response = await http.get("/metrics")
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            got = Scrape(await response.text())
            late = registry.late_outputs
            stats = (await (await http.get("/stats")).json())["aborted"]

    label = {"registry": "generate"}
    assert got.value("tether_requests_in_flight", **label) == 0
    assert got.value("tether_requests_opened_total", **label) == 8
    assert got.value("tether_requests_finished_total", **label) == 4
    assert got.value("tether_requests_failed_total", **label) == 1
    for reason in tether.AbortReason:
        expected = 1 if reason in ("client_disconnected", "timeout", "server") else 0
        value = got.value("tether_requests_aborted_total", reason=str(reason), **label)
        assert value == expected, reason
    assert got.value("tether_late_outputs_total", **label) == late
    assert stats == {"client_disconnected": 1, "timeout": 1, "server": 1}  # the JSON view

    assert got.value("tether_request_duration_seconds_count", **label) == 8
    durations = got.buckets("tether_request_duration_seconds", **label)
    assert durations[math.inf] == 8
    assert got.value("tether_request_duration_seconds_sum", **label) == pytest.approx(
        sum(end.total_time for end in times.ends.values())
    )
    assert got.value("tether_time_to_first_output_seconds_count", **label) == len(times.firsts)
    assert len(times.firsts) >= 7  # all but perhaps the one that timed out
