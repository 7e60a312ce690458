"""RedisStore.aclose() "ends every task" of the store. A reconnect whose claim is on
its way when its worker closes, and whose client leaves after the close (a server
shutting down: its clients go as it closes), withdraws its claim with a message to
the owner (``Mirror._tell``) spawned as a task of the store that closed. Nothing
awaits or cancels it any more, and since the merge of fix-review-watch it retries for
a whole lease period while Redis fails: a task left running after the store's close,
destroyed pending if the loop closes first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Final

import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore

import tether
import tether.resume

from .pipelines import AfterPipelines
from .test_redis_guarantees import _owner_read_one, _reconnect

pytestmark = pytest.mark.timeout(60)

BOUND: Final = 10.0


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_store_that_closed_owns_no_task_whatever_its_reconnects_do_after(
    redis: Redis,
) -> None:
    registry = tether.Registry()
    owner = tether.resume.Resume(grace=30.0, store=RedisStore(redis, block=1.0))
    sent = asyncio.Event()

    async def held(commands: list[tuple[Any, ...]]) -> None:
        if any("attach" in command for command in commands):
            sent.set()  # its claim landed; its sender has not heard so yet
            await asyncio.Event().wait()

    elsewhere = RedisStore(AfterPipelines(redis, held), block=1.0)  # type: ignore[arg-type]
    other = tether.resume.Resume(grace=30.0, store=elsewhere)
    left: set[asyncio.Task[Any]] = set()
    try:
        async with asyncio.timeout(BOUND):
            reader = await _owner_read_one(registry, owner, redis)
            scope = tether.RequestScope()
            reconnecting = _reconnect(scope, other, f"{reader.token}.1")
            await sent.wait()
            await other.aclose()  # the worker shuts down while the claim is on its way
            scope.disconnect()  # and its client goes
            with pytest.raises(tether.Aborted):
                await reconnecting
            left = {task for task in elsewhere._tasks if not task.done()}  # noqa: SLF001
    finally:
        for task in left:
            task.cancel()
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
    assert not left, f"the store closed, and still runs {left}"
