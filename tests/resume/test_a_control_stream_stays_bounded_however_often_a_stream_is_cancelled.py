"""Promised ("every post to a control stream is bounded"; ``CTL_MAXLEN``'s
docstring: "every ``XADD`` to one is bounded by it, whoever posts"; DESIGN invariant
14: every documented bound holds on every store, in bytes; Redis is a shared dependency
one client must not be able to fill)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore

import tether
import tether.resume
from tests._support.redis_server import redis_proc as redis_proc
from tests._support.redis_server import redis_url as redis_url

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)

PREFIX: Final = "tether:resume:"
BOUND: Final = 256


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_control_stream_stays_bounded_however_often_a_stream_is_cancelled_elsewhere(
    redis: Redis,
) -> None:
    registry = tether.Registry()
    owner_store = RedisStore(redis, block=0.1)
    other_store = RedisStore(redis, block=0.1)
    owner = tether.resume.Resume(grace=30.0, store=owner_store)
    other = tether.resume.Resume(grace=30.0, store=other_store)
    try:
        async with asyncio.timeout(30):
            stream = registry.open()
            first = await owner.open(stream)
            registry.deliver(stream.rid, 0)
            assert [output for _, output in await first.next_ready() or ()] == [0]
            await first.aclose()  # parked
            token = first.token

            async def copied() -> bool:
                keys = (f"{PREFIX}{token}:meta", f"{PREFIX}{token}:ctl")
                return bool(await redis.exists(*keys) == 2)

            await eventually(copied)
            for _ in range(1000):
                await other_store.cancel(token)  # the client asks again and again
            ctl = f"{PREFIX}{token}:ctl"
            entries = await redis.xlen(ctl)
    finally:
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
    # (MAXLEN ~ trims by whole nodes: twice the bound is lenient)
    assert entries <= 2 * BOUND, f"{entries} entries in {ctl} after 1000 cancels"
