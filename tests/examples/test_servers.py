"""The example servers end to end, as subprocesses on 127.0.0.1 (ephemeral ports).

One server of each kind serves the whole module; assertions on its counters use
differences, so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from engine import expected_text
from launch import launched

from .conftest import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["starlette", "aiohttp", "fastapi"]
)
async def url(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    async with launched(request.param, ["--step-ms", "2"]) as base:
        yield base


@pytest_asyncio.fixture(loop_scope="module")
async def http(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


async def metrics(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/stats")
    assert response.status_code == 200
    data: dict[str, Any] = response.json()
    return data


async def sse(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` included."""
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_generate_streams_every_token_in_order(http: httpx.AsyncClient) -> None:
    body = {"text": "hello", "max_tokens": 12, "stream": True}
    async with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await sse(response)
    assert events[-1] == "[DONE]"
    outputs = events[:-1]
    assert "".join(out["text"] for out in outputs) == expected_text("hello", 12)
    counts = [out["meta_info"]["completion_tokens"] for out in outputs]
    assert counts == sorted(counts)
    assert counts[-1] == 12
    assert outputs[-1]["meta_info"]["finish_reason"] == "length"


async def test_generate_batch_answers_a_list_in_prompt_order(http: httpx.AsyncClient) -> None:
    prompts = ["one", "two", "three"]
    response = await http.post("/generate", json={"text": prompts, "max_tokens": 6})
    assert response.status_code == 200
    results = response.json()
    assert [result["text"] for result in results] == [expected_text(p, 6) for p in prompts]
    assert all(result["meta_info"]["completion_tokens"] == 6 for result in results)


async def test_generate_batch_stream_events_carry_their_index(http: httpx.AsyncClient) -> None:
    prompts = ["left", "right"]
    body = {"text": prompts, "max_tokens": 5, "stream": True}
    async with http.stream("POST", "/generate", json=body) as response:
        events = await sse(response)
    assert events[-1] == "[DONE]"
    texts = ["", ""]
    for event in events[:-1]:
        texts[event["index"]] += event["output"]["text"]
    assert texts == [expected_text(p, 5) for p in prompts]


async def eventually_idle(http: httpx.AsyncClient) -> dict[str, Any]:
    """The server's metrics once nothing is in flight in tether or in the engine."""
    latest: dict[str, Any] = {}

    async def idle() -> bool:
        latest.update(await metrics(http))
        return latest["in_flight"] == 0 and latest["engine"]["running"] == 0

    await eventually(idle)
    return latest


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_client_disconnect_aborts_the_work(http: httpx.AsyncClient, stream: bool) -> None:
    before = await metrics(http)
    body = {"text": ["a", "b"], "max_tokens": 3000, "stream": stream}
    if stream:
        async with http.stream("POST", "/generate", json=body) as response:
            lines = response.aiter_lines()
            await anext(lines)
            await lines.aclose()  # and leaving the block closes the connection mid-stream
    else:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await http.post("/generate", json=body)
    after = await eventually_idle(http)
    aborted = after["aborted"].get("client_disconnected", 0)
    assert aborted - before["aborted"].get("client_disconnected", 0) == 2
    assert after["engine"]["aborted"] - before["engine"]["aborted"] == 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_request_past_its_timeout_gets_504_and_is_freed(
    http: httpx.AsyncClient, stream: bool
) -> None:
    body = {"text": ["slow", "slower"], "max_tokens": 4000, "timeout": 0.001, "stream": stream}
    response = await http.post("/generate", json=body)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "RequestTimeout"
    await eventually_idle(http)


async def test_openai_client_gets_completions_streamed_and_not(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    single = await client.completions.create(model="tether-sim", prompt="hello", max_tokens=7)
    assert single.choices[0].text == expected_text("hello", 7)
    assert single.choices[0].finish_reason == "length"
    assert single.usage is not None
    assert single.usage.completion_tokens == 7
    batch = await client.completions.create(model="m", prompt=["a", "b"], max_tokens=3)
    assert [choice.text for choice in batch.choices] == [expected_text(p, 3) for p in "ab"]
    texts = {0: "", 1: ""}
    stream = await client.completions.create(
        model="m", prompt=["a", "b"], max_tokens=9, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: expected_text("a", 9), 1: expected_text("b", 9)}
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="m", prompt="x", max_tokens=0)
    await client.close()


async def test_health_metrics_and_page_are_served(http: httpx.AsyncClient) -> None:
    health = await http.get("/health")
    assert (health.status_code, health.json()["status"]) == (200, "ok")
    data = await metrics(http)
    assert {"opened", "in_flight", "aborted", "late_outputs"} <= data.keys()
    assert {"running", "waiting", "max_batch"} <= data["engine"].keys()
    page = await http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert 'id="generate"' in page.text
