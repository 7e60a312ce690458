"""Review of the Redis mirror's withdrawn claim (82adcd1): Redis pauses (SIGSTOP)
during a reconnect's claim, for less than a lease period, and the client leaves."""

from __future__ import annotations

import asyncio
from typing import Any, Final

import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore

import tether
import tether.resume
from tests._support.redis_server import RedisProcess
from tests._support.redis_server import redis_proc as redis_proc
from tether.resume import Follower

from .conftest import eventually
from .pipelines import AfterPipelines

pytestmark = pytest.mark.timeout(60)

BOUND: Final = 15.0
PREFIX: Final = "tether:resume:"


async def test_a_claim_withdrawn_while_redis_is_paused_parks_the_stream_once_redis_is_back(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Promised (docs/resume.md): "An attach already on its way when its client leaves
    can still end a client that attached elsewhere meanwhile: ... the owner is told at
    once that the client which took its place left (the stream parks, its grace period
    runs)"; DESIGN invariant 14: "no failure state is permanent while it can recover".

    Redis pauses (SIGSTOP) right after the claim landed, and the client leaves. The
    worker has no idle connection to Redis left (under load its pool's connections are
    busy; here they are dropped), so the detach that withdraws the claim must connect.

    What happens: the detach is tried once; its connection cannot be made within one
    ``timeout`` against the paused Redis, and it is dropped with a warning ("the owner
    could not be told"). Redis comes back well within the claim's lease, but nothing
    tells the owner again: it holds the stream for the client that left until the
    lease lapses (three block periods, 3 s here), its own client already ended by
    that claim. (With an idle connection at hand the detach's bytes are written before
    its timeout and Redis runs it once back: the owner parks at once.)"""
    url = redis_proc.url
    registry = tether.Registry()
    owner_client, other_client = Redis.from_url(url), Redis.from_url(url)
    owner = tether.resume.Resume(grace=30.0, store=RedisStore(owner_client, block=1.0))
    sent = asyncio.Event()

    async def held(commands: list[tuple[Any, ...]]) -> None:
        if any("attach" in command for command in commands):
            redis_proc.pause()  # the claim landed; Redis stops answering
            await other_client.connection_pool.disconnect(inuse_connections=False)
            sent.set()
            await asyncio.Event().wait()  # its sender never hears that it landed

    elsewhere = RedisStore(AfterPipelines(other_client, held), block=1.0, timeout=0.5)  # type: ignore[arg-type]
    other = tether.resume.Resume(grace=30.0, store=elsewhere)
    parked = False
    try:
        async with asyncio.timeout(BOUND):
            stream = registry.open()
            reader = await owner.open(stream)  # the client reading on the owner
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await reader.next_ready() or ()] == [1]

            async def copied() -> bool:
                keys = (f"{PREFIX}{reader.token}:meta", f"{PREFIX}{reader.token}:log")
                return bool(await owner_client.exists(*keys) == 2)

            await eventually(copied)
            channel = owner.store.channel(reader.token)
            assert channel is not None
            scope = tether.RequestScope()
            point = tether.resume.resume_point(f"{reader.token}.1", None)
            assert point is not None

            async def reconnect() -> Follower | None:
                with scope:
                    return await other.follow(point)

            reconnecting = asyncio.create_task(reconnect())
            await sent.wait()
            await eventually(lambda: channel.remote)  # the owner heard the claim
            scope.disconnect()  # its client leaves while Redis is paused
            with pytest.raises(tether.Aborted):
                await reconnecting
            await eventually(lambda: "could not be told" in caplog.text)  # detach dropped
            redis_proc.resume()  # back, well within the claim's lease (3 s)
            try:
                await eventually(lambda: not channel.remote, timeout=1.0)
                parked = True
            except TimeoutError:
                parked = False
    finally:
        redis_proc.resume()
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        for client in (owner_client, other_client):
            await client.aclose()
    assert parked, "the owner held the stream for a client that left until its lease lapsed"
