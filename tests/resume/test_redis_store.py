"""RedisStore in one process standing for two workers (two stores, one Redis), on a
plain loop and on an eager-task loop: outputs delivered before the stream was made
resumable reach Redis too, and the other worker replays them all."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from tether_redis import RedisStore

import tether
import tether.resume
from tether.resume import resume_point

from .pipelines import AfterPipelines

pytestmark = pytest.mark.timeout(60)

_NOWHERE = tether.resume.ResumePoint("", -1)


async def _first_event(
    registry: tether.Registry, owner: tether.resume.Resume, stream: tether.Stream
) -> tether.resume.Follower:
    """Make ``stream`` resumable on ``owner``'s worker, deliver it 0 and read that."""
    first = await owner.open(stream)
    registry.deliver(stream.rid, 0)
    assert [output for _, output in await first.next_ready() or ()] == [0]
    return first


async def _follow(other: tether.resume.Resume, token: str, last: int) -> tether.resume.Follower:
    """A client on ``other``'s worker that read up to event ``last``, once the owner's
    writer has copied that far into Redis (in its own time)."""
    while True:
        mirror = await other.follow(resume_point(f"{token}.{last}", None) or _NOWHERE)
        if mirror is not None:
            return mirror
        await asyncio.sleep(0.01)


async def _leave(mirror: tether.resume.Follower) -> None:
    """That client leaves; wait for the tasks that tell the owner."""
    before = asyncio.all_tasks()
    await mirror.aclose()
    told = asyncio.all_tasks() - before
    if told:
        await asyncio.wait(told)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_outputs_ready_before_the_stream_was_resumable_reach_the_other_worker(
    redis: Redis,
) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    stream = registry.open()
    for n in range(3):  # ready before open(): an eager pump records them during open()
        registry.deliver(stream.rid, n)
    async with asyncio.timeout(10):
        first = await owner.open(stream)
        assert [output for _, output in await first.next_ready()] == [0, 1, 2]
        await first.aclose()  # the client leaves: parked
        registry.deliver(stream.rid, 3, finished=True)
        point = resume_point(None, first.token)
        assert point is not None
        while True:  # (the owner's writer copies to Redis in its own time)
            follower = await other.follow(point)
            assert follower is not None
            items = await follower.next_ready()
            seen = [output for _, output in items or ()]
            while (items := await follower.next_ready()) is not None:
                seen += [output for _, output in items]
            await follower.aclose()
            if seen == [0, 1, 2, 3]:
                break
            assert seen == [0, 1, 2, 3][: len(seen)]
        await other.aclose()
        await owner.aclose()
    assert not aborted
    assert registry.in_flight == 0


async def test_more_streams_than_the_client_has_connections_each_reach_the_other_worker(
    redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # redis.asyncio's pool holds 100 connections by default: one blocked read per
    # stream (owner or mirror) would exhaust it, and writes would fail.
    count = 150
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        streams = [registry.open() for _ in range(count)]
        firsts = [await owner.open(stream) for stream in streams]
        for stream in streams:
            registry.deliver(stream.rid, 0)
        for first in firsts:  # every client leaves after the first output: parked
            assert [output for _, output in await first.next_ready() or ()] == [0]
            await first.aclose()

        async def followed(token: str) -> tether.resume.Follower:
            while True:  # (the owner's writer copies to Redis in its own time)
                point = resume_point(f"{token}.1", None)
                assert point is not None
                follower = await other.follow(point)
                if follower is not None:
                    return follower
                await asyncio.sleep(0.01)

        mirrors = [await followed(first.token) for first in firsts]  # all listening at once
        for stream in streams:
            registry.deliver(stream.rid, 1)
            registry.deliver(stream.rid, 2, finished=True)
        for mirror in mirrors:
            seen = []
            while (items := await mirror.next_ready()) is not None:
                seen += [output for _, output in items]
            assert seen == [1, 2]
        await other.aclose()
        await owner.aclose()
    assert not aborted
    assert registry.in_flight == 0
    assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "WARNING")] == []


async def _until_gone(redis: Redis) -> None:
    """Shut the Redis server down and wait until it answers no more (bounded)."""
    with contextlib.suppress(RedisError):
        await redis.shutdown(nosave=True)
    async with asyncio.timeout(10):
        while True:
            try:
                await redis.ping()
            except RedisError:
                return
            await asyncio.sleep(0.01)


async def test_a_stream_whose_redis_died_goes_on_here_with_one_error_logged(
    redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await _first_event(registry, owner, stream)
        await _until_gone(redis)
        seen = []
        for n in range(1, 21):  # one at a time: each is recorded (and copied) on its own
            registry.deliver(stream.rid, n)
            seen += [output for _, output in await first.next_ready() or ()]
        assert seen == list(range(1, 21))
        # A stream opened while Redis is down is served too, resumable here only.
        later = registry.open()
        second = await owner.open(later)
        registry.deliver(later.rid, "x", finished=True)
        assert [output for _, output in await second.next_ready() or ()] == ["x"]
        await second.aclose()
        registry.deliver(stream.rid, 21, finished=True)
        assert [output for _, output in await first.next_ready() or ()] == [21]
        await first.aclose()
        await owner.aclose()
    assert not aborted
    assert registry.in_flight == 0
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len([message for message in errors if repr(stream.rid) in message]) == 1, errors


async def test_a_reconnect_while_redis_is_down_is_a_503_to_retry_and_stop_says_why(
    redis: Redis,
) -> None:
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        await _until_gone(redis)
        # The stream may live on its owner: not a 404 (it would make the client give up).
        answer = await other.reconnect({"last-event-id": "A" * 22 + ".1"}, {})
        assert isinstance(answer, tether.http.ErrorResponse)
        assert answer.status == 503
        assert answer.headers == {"retry-after": "1"}
        with pytest.raises(ConnectionError):
            await other.cancel("A" * 22)
        await other.aclose()


async def test_every_key_of_a_stream_expires_from_its_first_write(redis: Redis) -> None:
    # An owner killed before its first upkeep (one block period) must leave nothing
    # behind for ever: the upkeep is made rare here, so only the writes can set expiries.
    registry = tether.Registry()
    owner = tether.resume.Resume(store=RedisStore(redis, block=30.0))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await owner.open(stream)
        registry.deliver(stream.rid, 0)
        log = f"tether:resume:{first.token}:log"
        while True:  # (the owner's writer copies in its own time)
            if await redis.exists(log):
                break
            await asyncio.sleep(0.01)
        keys = await redis.keys(f"tether:resume:{first.token}:*")
        assert len(keys) == 3
        for key in keys:
            assert await redis.pttl(key) > 0, key
        await first.aclose()
        await owner.aclose()


async def test_a_client_elsewhere_that_leaves_after_the_stream_expired_leaves_no_key(
    redis: Redis,
) -> None:
    registry = tether.Registry()
    owner = tether.resume.Resume(grace=0.3, store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(grace=0.3, store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await owner.open(stream)
        registry.deliver(stream.rid, 0, finished=True)
        assert [output for _, output in await first.next_ready() or ()] == [0]
        await first.aclose()  # the stream is over; it stays resumable for its grace period
        while True:  # (the owner's writer copies the end in its own time)
            mirror = await other.follow(resume_point(f"{first.token}.1", None) or _NOWHERE)
            assert mirror is not None
            if await mirror.next_ready() is None:
                break
            await mirror.aclose()
        prefix = f"tether:resume:{first.token}:"
        mark = f"{prefix}end".encode()  # (the goodbye's mark: it expires by itself)

        async def keys() -> list[bytes]:
            return [key for key in await redis.keys(prefix + "*") if key != mark]

        while True:  # the owner forgets it: its keys go
            if not await keys():
                break
            await asyncio.sleep(0.02)
        await _leave(mirror)  # that client leaves only now: the owner is told
        assert await keys() == []
        assert await redis.pttl(mark) > 0
        await other.aclose()
        await owner.aclose()


async def test_a_client_elsewhere_that_leaves_while_redis_is_down_raises_into_no_task(
    redis: Redis,
) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    registry = tether.Registry()
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await _first_event(registry, owner, stream)
        mirror = await _follow(other, first.token, 0)
        await _until_gone(redis)
        await _leave(mirror)  # the owner cannot be told: logged, not raised
        gc.collect()
        await other.aclose()
        await owner.aclose()
    await registry.close(drain_timeout=0)
    assert unhandled == []


@pytest.mark.parametrize("cap", ["events", "bytes"])
async def test_a_client_elsewhere_that_lags_by_more_than_the_cap_ends_and_the_request_goes_on(
    redis: Redis, cap: str
) -> None:
    # Like the owner's log, a mirror holds at most the cap (of events, of bytes) its
    # client lags by (even when its worker reads Redis in time, so that MAXLEN trims
    # nothing unread): past it, that client ends with an error; the owner goes on.
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    # bytes: the 11th output of about 1 kB each is past the budget, and MAXLEN is far
    bound = {"max_events": 10} if cap == "events" else {"max_events": 1000, "max_bytes": 10_500}
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1), **bound)  # type: ignore[arg-type]
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1), **bound)  # type: ignore[arg-type]
    pad = "x" * 1000 if cap == "bytes" else ""
    async with asyncio.timeout(30):
        slow, probe = registry.open(), registry.open()
        mirrors = []
        for stream in (slow, probe):
            first = await _first_event(registry, owner, stream)
            mirror = await _follow(other, first.token, 1)
            with pytest.raises(tether.Aborted):  # the owner heard of the client elsewhere
                await first.next_ready()
            mirrors.append(mirror)
        lagging, reading = mirrors
        log = f"tether:resume:{lagging.token}:log"
        for n in range(1, 16):
            registry.deliver(slow.rid, f"{n}{pad}")
            while True:  # the slow stream's event (number n + 1: 0 was the first) is in Redis...
                last = await redis.xrevrange(log, count=1)
                if last and last[0][1].get(b"n") == str(n + 1).encode():
                    break
                await asyncio.sleep(0.005)
            # ... so the other worker's one reader has read it once it reads this one
            registry.deliver(probe.rid, n)
            assert [output for _, output in await reading.next_ready() or ()] == [n]
        registry.deliver(slow.rid, f"16{pad}", finished=True)
        registry.deliver(probe.rid, 16, finished=True)
        got: list[Any] = []

        async def read() -> None:
            while (items := await lagging.next_ready()) is not None:
                got.extend(output for _, output in items)

        with pytest.raises(tether.ConsumerTooSlow):
            await read()
        assert got == [f"{n}{pad}" for n in range(1, 12)]  # up to the cap, and one past it
        for mirror in mirrors:
            await mirror.aclose()
        await other.aclose()
        await owner.aclose()
    assert not aborted
    assert registry.in_flight == 0


async def test_a_client_elsewhere_is_told_when_its_own_worker_closes(redis: Redis) -> None:
    registry = tether.Registry()
    owner = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await _first_event(registry, owner, stream)
        mirror = await _follow(other, first.token, 0)
        await other.aclose()  # the mirror's worker shuts down: its client is told
        assert [output for _, output in await mirror.next_ready() or ()] == [0]
        with pytest.raises(tether.Aborted) as ended:
            await mirror.next_ready()
        assert ended.value.reason is tether.AbortReason.SERVER
        await mirror.aclose()
        await first.aclose()
        await owner.aclose()
    await registry.close(drain_timeout=0)


async def test_a_finished_stream_read_longer_than_its_grace_stays_resumable_elsewhere(
    redis: Redis,
) -> None:
    # The grace period starts when the last client leaves, not when the stream ended:
    # the keys in Redis must live as long as the owner holds the stream.
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    owner = tether.resume.Resume(grace=0.5, store=RedisStore(redis, block=0.1))
    other = tether.resume.Resume(grace=0.5, store=RedisStore(redis, block=0.1))
    async with asyncio.timeout(30):
        stream = registry.open()
        first = await owner.open(stream)
        registry.deliver(stream.rid, 0, finished=True)
        await asyncio.sleep(1.5)  # the client stays three grace periods (time is the point)
        assert [output for _, output in await first.next_ready() or ()] == [0]
        await first.aclose()  # now it leaves: resumable for another grace period
        mirror = await other.follow(resume_point(f"{first.token}.0", None) or _NOWHERE)
        assert mirror is not None
        assert [output for _, output in await mirror.next_ready() or ()] == [0]
        assert await mirror.next_ready() is None
        await mirror.aclose()
        await other.aclose()
        await owner.aclose()
    assert not aborted


async def test_a_reconnect_ahead_of_the_log_in_redis_waits_for_the_owners_writes(
    redis: Redis,
) -> None:
    # The owner sends each event to its own client before its writer has put it in
    # Redis: a client that drops right then reconnects on another worker with an id
    # the log does not hold yet. That id is not unknown: the reconnect waits for the
    # log to catch up and continues after it, once.
    read = asyncio.Event()  # it read the log once (its first pipeline: meta and log)

    async def seen(commands: list[tuple[Any, ...]]) -> None:
        read.set()

    spy = AfterPipelines(redis, seen)
    other = tether.resume.Resume(store=RedisStore(spy, block=0.1))  # type: ignore[arg-type]
    key = RedisStore(redis).key
    token = tether.resume.new_token()
    await redis.hset(key(token, "meta"), mapping={"rid": "owned-elsewhere", "m": 100})
    await redis.xadd(key(token, "ctl"), {"op": "open"})
    for n in (1, 2, 3):
        await redis.xadd(key(token, "log"), {"n": n, "d": str(n * 10)})
    async with asyncio.timeout(10):
        following = asyncio.create_task(other.follow(resume_point(f"{token}.5", None)))  # type: ignore[arg-type]
        await read.wait()  # it read the log as it stands: events 1-3 of the 5 seen
        for n in (4, 5, 6):
            await redis.xadd(key(token, "log"), {"n": n, "d": str(n * 10)})
        follower = await following
        assert follower is not None
        assert [output for _, output in await follower.next_ready()] == [60]
        await redis.xadd(key(token, "log"), {"end": "ok"})
        assert await follower.next_ready() is None
        await follower.aclose()
        # An id past every event of an ended stream is still unknown.
        assert await other.follow(resume_point(f"{token}.9", None)) is None  # type: ignore[arg-type]
    await other.aclose()
