"""Resumption across workers through Redis Streams: two front processes (Starlette on
uvicorn, aiohttp) share a real ``redis-server`` on a free loopback port; a client that
drops on one continues on the other, exactly once and in order; Stop, the grace period
and the newest-client rule hold across them; only the owner aborts, once."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests._support.processes import stop
from tether.http import TOKEN_HEADER

from .conftest import BOUND, Reader, client, connect

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def front(adapter: str, redis: str, *options: str) -> AsyncIterator[str]:
    """A front worker process (``redis_front``); its base URL. Stopped by closing its
    standard input; its output is shown if it fails to start."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-u", "-m", "tests.resume.redis_front",
        "--adapter", adapter, "--redis", redis, *options,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stdin is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            async for raw in process.stdout:
                line = raw.decode().rstrip()
                seen.append(line)
                if "listening on " in line:
                    break
        assert seen, "the front printed nothing"
        assert "listening on " in seen[-1], "\n".join(seen)
        yield seen[-1].rsplit("listening on ", 1)[1]
    finally:
        process.stdin.close()
        await stop(process, None, grace=BOUND)


@contextlib.asynccontextmanager
async def two_fronts(redis: str, *options: str) -> AsyncIterator[tuple[str, str]]:
    async with front("starlette", redis, *options) as a, front("aiohttp", redis, *options) as b:
        yield a, b


async def books(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/books") as response:
        result: dict[str, Any] = await response.json()
        return result


async def until(session: aiohttp.ClientSession, url: str, check: Any) -> dict[str, Any]:
    """Poll a front's books (bounded) until ``check(books)`` holds; the books."""
    async with asyncio.timeout(BOUND):
        while True:
            found = await books(session, url)
            if check(found):
                return found
            await asyncio.sleep(0.02)


async def test_a_client_that_drops_on_one_worker_continues_on_another(redis_url: str) -> None:
    async with two_fronts(redis_url) as (a, b), client() as session:
        first = await connect(session, f"{a}/gen", params={"n": "60", "every": "0.02"})
        seen = await first.take(10)
        first.close()
        second = await connect(session, f"{b}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert second.token == first.token
        seen += await second.rest()
        assert seen == [*({"n": n} for n in range(60)), "[DONE]"]
        owner = await until(session, a, lambda found: found["in_flight"] == 0)
        assert owner["aborts"] == {}
        assert (await books(session, b))["opened"] == []  # B only followed


async def test_a_finished_stream_resumes_on_another_worker_within_grace(redis_url: str) -> None:
    async with two_fronts(redis_url) as (a, b), client() as session:
        first = await connect(session, f"{a}/gen", params={"n": "5", "every": "0.001"})
        seen = await first.take(2)
        first.close()
        await until(session, a, lambda found: found["in_flight"] == 0)
        second = await connect(session, f"{b}/gen", params={"last_event_id": str(first.last_id)})
        seen += await second.rest()
        assert seen == [*({"n": n} for n in range(5)), "[DONE]"]
        assert (await books(session, a))["aborts"] == {}


async def test_stop_on_another_worker_aborts_the_owner_at_once(redis_url: str) -> None:
    async with two_fronts(redis_url) as (a, b), client() as session:
        first = await connect(session, f"{a}/gen", params={"n": "100000", "every": "0.01"})
        await first.take(1)
        stop = await session.post(f"{b}/stop", headers={TOKEN_HEADER: str(first.token)})
        assert stop.status == 204
        owner = await until(session, a, lambda found: found["in_flight"] == 0)
        assert list(owner["aborts"].values()) == [1]
        rest = await first.rest()
        assert "[DONE]" not in rest  # the client was ended, not finished
        again = await session.get(f"{b}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert again.status == 404


async def test_a_stream_parked_past_its_grace_is_aborted_once_and_resumable_nowhere(
    redis_url: str,
) -> None:
    async with two_fronts(redis_url, "--grace", "0.5") as (a, b), client() as session:
        first = await connect(session, f"{a}/gen", params={"n": "100000", "every": "0.01"})
        await first.take(3)
        first.close()
        owner = await until(session, a, lambda found: found["in_flight"] == 0)
        assert list(owner["aborts"].values()) == [1]
        late = await session.get(f"{b}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert late.status == 404
        wrong = await session.get(f"{b}/gen", headers={"Last-Event-ID": "nonesuch.1"})
        assert wrong.status == 404
        assert await late.read() == await wrong.read()


async def test_a_newer_client_on_another_worker_ends_the_older_one(redis_url: str) -> None:
    async with two_fronts(redis_url) as (a, b), client() as session:
        first = await connect(session, f"{a}/gen", params={"n": "150", "every": "0.01"})
        seen = await first.take(5)
        second = await connect(session, f"{b}/gen", headers={"Last-Event-ID": str(first.last_id)})
        older: list[Any] = await first.rest()
        assert "[DONE]" not in older  # replaced: it ends without the terminal frame
        third = Reader(second.response)
        seen += await third.rest()
        assert seen == [*({"n": n} for n in range(150)), "[DONE]"]
        owner = await until(session, a, lambda found: found["in_flight"] == 0)
        assert owner["aborts"] == {}


async def test_a_client_on_another_worker_is_told_when_the_owner_shuts_down(
    redis_url: str,
) -> None:
    async with front("aiohttp", redis_url) as b, client() as session:
        async with front("starlette", redis_url) as a:
            first = await connect(session, f"{a}/gen", params={"n": "100000", "every": "0.01"})
            await first.take(2)
            follower = await connect(
                session, f"{b}/gen", headers={"Last-Event-ID": str(first.last_id)}
            )
            await follower.take(2)
        told = await follower.next()  # the owner aborted its request as it stopped
        while told is not None and told.event != "error":
            told = await follower.next()
        assert told is not None
        assert told.data["error"]["code"] == 503
        assert await follower.rest() == ["[DONE]"]
