"""The one reader of a worker's Redis streams (``tether_redis._ear.Ear``) with several
listeners on one key, each at its own position, against a real ``redis-server``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from redis.asyncio import Redis
from tether_redis._ear import Ear, Fields

from .conftest import eventually


class _Heard:
    """A listener that keeps the numbers of the entries it hears."""

    def __init__(self) -> None:
        self.numbers: list[int] = []

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        self.numbers.append(int(fields[b"n"]))
        return True

    async def tick(self) -> bool:
        return True

    def silent(self) -> bool:
        return True


async def _blocked_read(client: Redis) -> bool:
    """Whether some client of Redis waits in an ``XREAD BLOCK``."""
    clients: list[dict[str, Any]] = await client.client_list()
    return any(one.get("cmd") == "xread" and "b" in one.get("flags", "") for one in clients)


async def test_a_listener_joining_a_key_during_a_read_from_further_on_misses_nothing(
    redis_url: str,
) -> None:
    client = Redis.from_url(redis_url)
    tasks: set[asyncio.Task[None]] = set()

    def spawn(job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(job)
        tasks.add(task)
        return task

    async def nothing() -> None:
        pass

    key = "ear-test:log"
    # (a long block and no poke: the read in flight stays the one that started before
    # the second listener joined)
    ear = Ear(
        client,
        "ear-test:wake",
        5_000,
        5.0,
        spawn,
        nothing,
        lambda: None,
        lambda: None,
        lambda deadline: None,
    )
    ahead, behind = _Heard(), _Heard()
    try:
        async with asyncio.timeout(20):
            await client.delete(key)
            for n in (1, 2, 3):
                await client.xadd(key, {"n": str(n)}, id=f"{n}-0")
            ear.listen(ahead, {key: "0-0"})
            await eventually(lambda: ahead.numbers == [1, 2, 3])
            await eventually(lambda: _blocked_read(client))  # reading on from 3-0
            ear.listen(behind, {key: "1-0"})  # (it had entry 1 already)
            await client.xadd(key, {"n": "4"}, id="4-0")
            await eventually(lambda: ahead.numbers == [1, 2, 3, 4])
            await client.xadd(key, {"n": "5"}, id="5-0")
            await eventually(lambda: 5 in behind.numbers)
            assert behind.numbers == [2, 3, 4, 5]
            assert ahead.numbers == [1, 2, 3, 4, 5]
    finally:
        ear.drop(ahead)
        ear.drop(behind)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.delete(key)
        await client.aclose()
