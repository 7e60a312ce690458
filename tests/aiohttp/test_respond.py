"""respond(): JSON, streamed and batch bodies, errors before and after the first
output, pings and HEAD, through pytest-aiohttp's client."""

from __future__ import annotations

import asyncio
import json

from pytest_aiohttp import AiohttpClient

import tether

from .conftest import Env, build_app, sse_events

BOUND = 10.0


async def test_streaming_response_sends_every_output_then_the_terminal_frame(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "3"})
        body = await response.read()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Rid"] == env.tracker.opened[0]
    assert sse_events(body) == [{"text": "0.0"}, {"text": "0.1"}, {"text": "0.2"}, "[DONE]"]
    assert env.registry.in_flight == 0
    assert env.tracker.aborted == {}


async def test_ndjson_streaming_response_has_one_line_per_output(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "2", "ndjson": ""})
        body = await response.read()
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/x-ndjson"
    assert [json.loads(line) for line in body.splitlines()] == [{"text": "0.0"}, {"text": "0.1"}]


async def test_json_response_is_the_result(env: Env, aiohttp_client: AiohttpClient) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "3", "streaming": "0"})
        body = await response.json()
    assert response.status == 200
    assert body == {"text": "0.2"}
    assert env.registry.in_flight == 0


async def test_batch_json_response_is_the_list_of_results_in_order(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "2", "batch": "3", "streaming": "0"})
        body = await response.json()
    assert response.status == 200
    assert body == [{"text": "0.1"}, {"text": "1.1"}, {"text": "2.1"}]
    assert env.registry.in_flight == 0


async def test_batch_streaming_response_tags_each_output_with_its_index(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "1", "batch": "2"})
        events = sse_events(await response.read())
    assert response.status == 200
    assert sorted(events[:-1], key=lambda event: event["index"]) == [
        {"index": 0, "output": {"text": "0.0"}},
        {"index": 1, "output": {"text": "1.0"}},
    ]
    assert events[-1] == "[DONE]"


async def test_producer_failure_before_the_first_output_is_a_500_with_a_json_body(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "0", "end": "fail"})
        body = await response.json()
    assert response.status == 500
    assert body["error"]["type"] == "ProducerError"
    assert body["error"]["code"] == 500
    assert env.registry.in_flight == 0


async def test_timeout_before_the_first_output_is_a_504(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "0", "end": "hold", "timeout": "0.01"})
        body = await response.json()
    assert response.status == 504
    assert body["error"]["type"] == "RequestTimeout"
    assert env.registry.in_flight == 0
    assert env.tracker.aborted.keys() == set(env.tracker.opened)


async def test_overloaded_registry_is_a_503_with_retry_after(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    env.registry = tether.Registry(env.tracker.on_abort, max_in_flight=1)
    env.producer.registry = env.registry
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        holding = await client.get("/", params={"n": "1", "end": "hold"})
        await holding.content.readuntil(b"\n\n")
        response = await client.get("/")
        body = await response.json()
        holding.close()
        await env.tracker.until(lambda: env.registry.in_flight == 0)
    assert response.status == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert body["error"]["type"] == "Overloaded"


async def test_failure_after_the_first_output_is_one_error_event_and_the_terminal_frame(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "2", "end": "fail"})
        events = sse_events(await response.read())
    assert response.status == 200
    assert events[:2] == [{"text": "0.0"}, {"text": "0.1"}]
    assert events[2]["error"]["type"] == "ProducerError"
    assert events[3:] == ["[DONE]"]
    assert env.registry.in_flight == 0


async def test_idle_stream_sends_its_headers_with_a_ping(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.get("/", params={"n": "0", "end": "hold", "ping": "0.01"})
        first = await response.content.readuntil(b"\n\n")
        response.close()
        await env.tracker.until(lambda: env.registry.in_flight == 0)
    assert response.status == 200
    assert first == b": ping\n\n"
    assert env.tracker.aborted.keys() == set(env.tracker.opened)


async def test_head_sends_the_headers_only_and_aborts_the_work(
    env: Env, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(build_app(env))
    async with asyncio.timeout(BOUND):
        response = await client.head("/", params={"end": "hold"})
        body = await response.read()
        await env.tracker.until(lambda: env.tracker.handled == env.tracker.opened)
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert body == b""
    assert env.registry.in_flight == 0
    assert env.tracker.aborted.keys() == set(env.tracker.opened)
