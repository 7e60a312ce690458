"""A reconnect on a worker that does not own its stream waits for the log in Redis
before any stream is tracked for its request (``Resume.follow``, a ``Last-Event-ID``
ahead of what Redis holds). A client that leaves during that wait is noticed on every
adapter, on a real server (uvicorn, aiohttp with and without handler cancellation)
and a real ``redis-server``: the wait is cut at once, nothing keeps listening for it,
and no claim is posted, so the client reading on the owner reads on; even when the
client leaves as a command of the wait is written, the turn in which Python 3.11's
``asyncio.wait_for`` (around every command redis-py sends) drops a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Final

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from tether_redis import RedisStore

import tether
import tether.resume
from tests._support.raw_http import connection, leave, request
from tether.resume import Follower

from .conftest import BOUND, eventually, serving

pytestmark = pytest.mark.timeout(60)

PREFIX: Final = "tether:resume:"

NOTICED: Final = 1.0
"""Seconds within which the wait must be cut: well under the 2 s a reconnect ahead of
the log waits for it to catch up (which is what a missed disconnect costs)."""


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _holds(predicate: Callable[[], bool], within: float) -> bool:
    """Whether ``predicate()`` comes to hold within ``within`` seconds."""
    try:
        await eventually(predicate, timeout=within)
    except TimeoutError:
        return False
    return True


async def _claims(redis: Redis, token: str, worker: str) -> list[dict[bytes, bytes]]:
    """The claims (``attach`` entries) ``worker`` posted to ``token``'s control stream."""
    entries = await redis.xrange(f"{PREFIX}{token}:ctl")
    return [
        fields
        for _, fields in entries
        if fields.get(b"op") == b"attach" and fields.get(b"w") == worker.encode()
    ]


async def _rest(follower: Follower) -> list[Any] | str:
    seen: list[Any] = []
    try:
        while (items := await follower.next_ready()) is not None:
            seen += [output for _, output in items]
    except tether.TetherError as exc:
        return f"{type(exc).__name__}: {exc}"
    return seen


async def test_a_reconnect_whose_client_leaves_while_it_waits_posts_no_claim(
    adapter: str, redis: Redis
) -> None:
    registry = tether.Registry()
    owner = tether.resume.Resume(grace=30.0, store=RedisStore(redis, block=0.1))
    elsewhere = RedisStore(redis, block=0.1)
    try:
        async with serving(adapter, store=elsewhere) as site:
            stream = registry.open()
            reader = await owner.open(stream)  # the client reading on the owner
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await reader.next_ready() or ()] == [1]
            log, ctl = (f"{PREFIX}{reader.token}:{kind}" for kind in ("log", "ctl"))

            async def copied() -> bool:  # (event 1 is in Redis: a reconnect finds it)
                return bool(await redis.exists(log))

            await eventually(copied)
            listened = elsewhere.ear._keys  # noqa: SLF001 (what the server's one reader follows)

            def waiting() -> bool:  # it follows the log for the reconnect, unclaimed
                return log in listened and ctl not in listened

            async with connection(site.url) as (_, writer):
                # one event ahead of the log: the reconnect waits for it to catch up
                writer.write(request("GET", f"/gen?last_event_id={reader.token}.2"))
                await eventually(waiting)
                await leave(writer)
                cut = await _holds(lambda: not waiting(), NOTICED)
            registry.deliver(stream.rid, 2)  # the owner's client reads on
            await eventually(lambda: not waiting())  # (a reconnect that missed it: over)
            claims = await _claims(redis, reader.token, elsewhere.worker)
            registry.deliver(stream.rid, 3, finished=True)
            async with asyncio.timeout(BOUND):
                outcome = await _rest(reader)
    finally:
        await registry.close(drain_timeout=0)
        await owner.aclose()
    assert cut, f"the reconnect still waited {NOTICED} s after its client left"
    assert claims == [], "a client that left was claimed for the stream"
    assert outcome == [2, 3], f"the client reading on the owner: {outcome}"


def _packed(command: Iterable[Any]) -> bytes:
    return b"".join(bytes(part) for part in command)


async def test_a_reconnect_whose_client_leaves_as_its_look_is_sent_is_cut_at_once(
    redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves in the turn the reconnect's look at the log (its first
    pipeline) has been written to Redis: ``disconnect()`` runs from a callback of that
    turn, as the server's notice of the client leaving may. On 3.11 that cancellation
    lands in redis-py's ``wait_for`` around the send, whose inner task has just
    completed, and is dropped: the cut must not hang on it (a reconnect that missed it
    waited the whole catch-up, 2 s, and answered 404 for nobody). It ends ``Aborted``
    within ``NOTICED``."""
    registry = tether.Registry()
    owner = tether.resume.Resume(grace=30.0, store=RedisStore(redis, block=0.1))
    other_client = Redis.from_url(redis_url)
    other = tether.resume.Resume(grace=30.0, store=RedisStore(other_client, block=0.1))
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
