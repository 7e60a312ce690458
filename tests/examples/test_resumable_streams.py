"""The example servers offer resumption on ``/generate`` and ``/v1/completions``
(``"resume": true``): a client that drops mid-stream reconnects with ``Last-Event-ID``
and the text it puts together is the whole answer, once; the books balance (nothing
aborted, nothing left). With ``--redis``, two example server processes (Starlette on
uvicorn, aiohttp) share one ``redis-server``: a client that drops on one continues on
the other. ``POST /generate/stop`` stops a resumable stream at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from engine import expected_text  # (examples/ is on the path: tests/examples/conftest.py)
from launch import launched

from tests.examples.reliability.harness import SERVERS, running, service
from tests.resume.conftest import BOUND, Reader, client
from tether.resume import TOKEN_HEADER

pytestmark = pytest.mark.timeout(60)


def _text(events: list[Any]) -> str:
    return "".join(event["text"] for event in events if isinstance(event, dict))


def _completion_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))


ROUTES = {
    "/generate": ("text", _text),
    "/v1/completions": ("prompt", _completion_text),
}
"""Each streaming route: the field of its prompt, and the text a client puts together."""


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", SERVERS)
async def test_a_dropped_generation_resumes_and_the_text_is_whole_once(
    name: str, route: str
) -> None:
    prompt, tokens = "resume me", 300
    field, text_of = ROUTES[route]
    body = {field: prompt, "max_tokens": tokens, "stream": True, "resume": True}
    async with running(name, service(step_interval=0.005)) as server, client() as session:
        response = await session.post(f"{server.url}{route}", json=body)
        assert response.status == 200
        first = Reader(response)
        seen = await first.take(5)
        first.close()
        again = await session.post(  # (the same body: /v1/completions reads its model)
            f"{server.url}{route}", json=body, headers={"Last-Event-ID": str(first.last_id)}
        )
        assert again.status == 200
        seen += await Reader(again).rest()
        assert seen[-1] == "[DONE]"
        assert text_of(seen) == expected_text(prompt, tokens)
        if route == "/v1/completions":  # one completion, whichever connection carried it
            ids = {event["id"] for event in seen if isinstance(event, dict)}
            assert len(ids) == 1
            assert ids.pop().startswith("cmpl-")
        await server.idle()
        assert server.ledger.problems() == []
        assert not server.ledger.aborts


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "stream": False, "resume": True},
        {"text": ["x", "y"], "stream": True, "resume": True},
        {"text": "x", "stream": True, "resume": "yes"},
    ],
    ids=["not-streamed", "batch", "not-a-flag"],
)
async def test_resume_is_refused_where_it_cannot_apply(body: dict[str, Any]) -> None:
    async with running("starlette", service()) as server, client() as session:
        response = await session.post(f"{server.url}/generate", data=json.dumps(body))
        assert response.status == 422
        assert server.ledger.in_flight == 0


@pytest.mark.parametrize("name", SERVERS)
async def test_stop_by_token_aborts_a_resumable_generation_at_once(name: str) -> None:
    body = {"text": "stop me", "max_tokens": 4000, "stream": True, "resume": True}
    async with running(name, service(step_interval=0.005)) as server, client() as session:
        response = await session.post(f"{server.url}/generate", json=body)
        reader = Reader(response)
        await reader.take(3)
        assert reader.token is not None
        stop = {TOKEN_HEADER: reader.token}
        async with session.post(f"{server.url}/generate/stop", headers=stop) as stopped:
            assert stopped.status == 204
        rest = await reader.rest()  # the client attached ends: its body ends, unfinished
        assert "[DONE]" not in rest
        await server.idle()
        assert dict(server.ledger.stats().aborted) == {"cancelled": 1}
        assert list(server.ledger.aborts.values()) == [1]  # on_abort, once
        async with session.post(f"{server.url}/generate/stop", headers=stop) as again:
            assert again.status == 404  # forgotten: a second Stop finds nothing
        assert server.ledger.problems() == []


async def _stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/stats") as response:
        stats: dict[str, Any] = await response.json()
        return stats


async def _settled(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """A server's stats once nothing is in flight (its books settle after the end)."""
    async with asyncio.timeout(BOUND):
        while True:
            stats = await _stats(session, url)
            if stats["in_flight"] == 0:
                return stats
            await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    ("owner", "other"), [("starlette", "aiohttp"), ("aiohttp", "starlette"), ("fastapi", "aiohttp")]
)
async def test_a_generation_dropped_on_one_example_server_resumes_on_another_through_redis(
    redis_url: str, owner: str, other: str
) -> None:
    prompt, tokens = "across workers", 300
    body = {"text": prompt, "max_tokens": tokens, "stream": True, "resume": True}
    options = ["--redis", redis_url, "--step-ms", "5"]
    async with (
        launched(owner, options) as a,
        launched(other, options) as b,
        client() as session,
    ):
        response = await session.post(f"{a}/generate", json=body)
        assert response.status == 200
        first = Reader(response)
        seen = await first.take(5)
        first.close()
        last = {"Last-Event-ID": str(first.last_id)}
        again = await session.post(f"{b}/generate", json=body, headers=last)
        assert again.status == 200
        second = Reader(again)
        assert second.token == first.token
        seen += await second.rest()
        assert seen[-1] == "[DONE]"
        assert _text(seen) == expected_text(prompt, tokens)  # whole, once, in order

        books = await _settled(session, a)
        assert (books["opened"], books["finished"], books["aborted"]) == (1, 1, {})
        assert (await _stats(session, b))["opened"] == 0  # the other server only followed


@pytest.mark.parametrize("route", ROUTES)
async def test_the_fastapi_example_resumes_a_dropped_stream_too(route: str) -> None:
    prompt, tokens = "resume me on fastapi", 300
    field, text_of = ROUTES[route]
    body = {field: prompt, "max_tokens": tokens, "stream": True, "resume": True}
    async with launched("fastapi") as url, client() as session:
        first = Reader(await session.post(f"{url}{route}", json=body))
        seen = await first.take(5)
        first.close()
        last = {"Last-Event-ID": str(first.last_id)}
        again = await session.post(f"{url}{route}", json=body, headers=last)
        assert again.status == 200
        seen += await Reader(again).rest()
        assert seen[-1] == "[DONE]"
        assert text_of(seen) == expected_text(prompt, tokens)
        books = await _settled(session, url)
        assert (books["opened"], books["finished"], books["aborted"]) == (1, 1, {})


@pytest.mark.parametrize("name", ["starlette", "aiohttp", "fastapi"])
async def test_stop_while_the_shared_store_is_down_is_a_503_to_retry(
    redis_url: str, name: str
) -> None:
    from redis.asyncio import Redis
    from redis.exceptions import RedisError

    async with launched(name, ["--redis", redis_url]) as url, client() as session:
        redis = Redis.from_url(redis_url)
        try:
            with contextlib.suppress(RedisError):
                await redis.shutdown(nosave=True)
            async with asyncio.timeout(BOUND):  # until it answers no more
                while True:
                    try:
                        await redis.ping()
                    except RedisError:
                        break
                    await asyncio.sleep(0.01)
        finally:
            await redis.aclose()
        stop = {TOKEN_HEADER: "a" * 32}
        async with session.post(f"{url}/generate/stop", headers=stop) as refused:
            assert refused.status == 503
            assert refused.headers["Retry-After"] == "1"
            assert (await refused.json())["error"]["code"] == 503
