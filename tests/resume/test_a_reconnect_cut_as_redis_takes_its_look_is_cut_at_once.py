"""Review of RequestScope.waiting() on Python 3.11 (82adcd1): the cut is one
``Task.cancel()``, and 3.11's ``asyncio.wait_for`` drops a cancellation that arrives as
the awaitable it wraps completes. redis-py wraps every command it sends in one (its
socket timeout), so a client that leaves in the turn a command of the reconnect's was
written has its cut swallowed; nothing cuts the wait again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from tether_redis import RedisStore

import tether
import tether.resume
from tether.resume import Follower

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)

BOUND: Final = 10.0
PREFIX: Final = "tether:resume:"

NOTICED: Final = 1.0
"""Seconds within which the wait must be cut: well under the 2 s a reconnect ahead of
the log waits for it to catch up (which is what a missed disconnect costs)."""


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _packed(command: Iterable[Any]) -> bytes:
    return b"".join(bytes(part) for part in command)


async def test_a_reconnect_whose_client_leaves_as_its_look_is_sent_is_cut_at_once(
    redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Promised (CHANGELOG, docs/starlette.md, RequestScope.waiting): "the client's
    leaving cuts the wait (the request ends Aborted, 499)"; the wait is cut "at once",
    and nothing keeps listening for it (tests/resume/test_a_reconnect_whose_client_
    leaves_while_it_waits.py: within 1 s, where a missed disconnect costs the 2 s
    catch-up).

    The client leaves in the turn the reconnect's look at the log (its first pipeline)
    has been written to Redis: ``disconnect()`` runs from a callback of that turn, as
    the server's notice of the client leaving may.

    What happens on 3.11: the cut's ``cancel()`` lands in redis-py's ``wait_for``
    around the send, whose inner task has just completed; ``wait_for`` returns its
    result and drops the cancellation. The look goes on: the mirror listens on the log
    and waits the whole catch-up (2 s) for a client that left, and the wait is never cut
    again (``_cut_waits`` skips a wait already marked ``cut``); it finally returns
    ``None`` (a 404 for nobody) instead of ``Aborted``."""
    registry = tether.Registry()
    owner = tether.resume.Resume(grace=30.0, store=RedisStore(redis, block=0.1))
    other_client = Redis.from_url(redis_url)
    elsewhere = RedisStore(other_client, block=0.1)
    other = tether.resume.Resume(grace=30.0, store=elsewhere)
    scope = tether.RequestScope()
    armed = False
    sent = _original = Connection._send_packed_command  # noqa: SLF001 (where redis-py writes)

    async def send(self: Connection, command: Iterable[Any]) -> None:
        nonlocal armed
        await sent(self, command)
        if armed and b"HGETALL" in _packed(command):  # the reconnect's look is written
            armed = False
            asyncio.get_running_loop().call_soon(scope.disconnect)  # its client leaves

    monkeypatch.setattr(Connection, "_send_packed_command", send)
    outcome: object = None
    took = float("inf")
    try:
        async with asyncio.timeout(BOUND):
            stream = registry.open()
            reader = await owner.open(stream)  # the client reading on the owner
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await reader.next_ready() or ()] == [1]
            log = f"{PREFIX}{reader.token}:log"
            await eventually(lambda: redis.exists(log))
            # one event ahead of the log: the reconnect waits for it to catch up
            point = tether.resume.resume_point(f"{reader.token}.2", None)
            assert point is not None

            async def reconnect() -> Follower | None:
                with scope:
                    return await other.follow(point)

            loop = asyncio.get_running_loop()
            armed = True
            started = loop.time()
            try:
                outcome = await reconnect()
            except tether.Aborted as exc:
                outcome = exc
            took = loop.time() - started
    finally:
        monkeypatch.setattr(Connection, "_send_packed_command", _original)
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        await other_client.aclose()
    assert scope.disconnected
    said = f"the reconnect whose client left ended after {took:.2f} s with {outcome!r}"
    assert took < NOTICED, said
    assert isinstance(outcome, tether.Aborted), said
