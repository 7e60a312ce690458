"""Resumption across workers through Redis Streams: two front processes (Starlette on
uvicorn, aiohttp) share a real ``redis-server`` on a free loopback port; a client that
drops on one continues on the other, exactly once and in order; Stop, the grace period
and the newest-client rule hold across them; only the owner aborts, once."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tether.resume import TOKEN_HEADER

from .conftest import Reader, client, connect
from .fronts import books, front, until

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def two_fronts(redis: str, *options: str) -> AsyncIterator[tuple[str, str]]:
    async with front("starlette", redis, *options) as a, front("aiohttp", redis, *options) as b:
        yield a, b


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
