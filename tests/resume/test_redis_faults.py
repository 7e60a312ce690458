"""RedisStore against a Redis that fails: paused (SIGSTOP), restarted empty, capped
with ``maxclients``, evicting under ``maxmemory``, flooded, or heard late by one
worker (its clients' claims must still be judged in the control stream's order). Two
stores in one process stand for two workers sharing one ``redis-server`` that the test
starts on a free loopback port. Every command is bounded, no failure is permanent
while Redis can come back, and one request's Redis work never starves another's."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore
from tether_redis._ear import entry_order

import tether
import tether.resume
from tests._support.redis_server import RedisProcess, redis_process
from tether.resume import Follower, ResumePoint, resume_point

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)

BLOCK = 0.1
"""The stores' block period: leases, upkeep and re-publication run this often."""


def _point(token: str, last: int) -> ResumePoint:
    point = resume_point(f"{token}.{last}", None)
    assert point is not None
    return point


async def _drain(follower: Follower) -> list[Any]:
    """Every output the follower hands out until its stream ends."""
    seen: list[Any] = []
    while (items := await follower.next_ready()) is not None:
        seen += [output for _, output in items]
    return seen


async def _reach(other: tether.resume.Resume, token: str, last: int) -> Follower:
    """A client on ``other``'s worker that read up to event ``last``, retried while
    the owner's copy is not in Redis yet (a 404) or Redis cannot say (a 503)."""
    while True:
        try:
            follower = await other.follow(_point(token, last))
        except ConnectionError:
            follower = None
        if follower is not None:
            return follower
        await asyncio.sleep(0.02)


async def _first_read(
    registry: tether.Registry, owner: tether.resume.Resume, *, leave: bool = False
) -> tuple[tether.Stream, Follower]:
    """A resumable stream on ``owner``'s worker whose client read its first output
    (and left, with ``leave``)."""
    stream = registry.open()
    first = await owner.open(stream)
    registry.deliver(stream.rid, 0)
    assert [output for _, output in await first.next_ready() or ()] == [0]
    if leave:
        await first.aclose()
    return stream, first


class _HardOfHearing(Redis):
    """A client whose ``XREAD`` answers wait at the door while ``hearing`` is clear:
    its store's one reader hears late what other workers posted meanwhile, as one held
    up by a slow Redis or a busy loop does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hearing = asyncio.Event()
        self.hearing.set()
        self._marks: list[tuple[str, tuple[int, int], asyncio.Event]] = []

    async def xread(self, streams: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        for key, mark, past in self._marks:
            position = streams.get(key)
            if position is not None and entry_order(position) >= mark:
                past.set()
        answer = await super().xread(streams, *args, **kwargs)
        await self.hearing.wait()
        return answer

    async def heard_all_of(self, key: str) -> None:
        """Let the store hear again, and wait until it handled every entry ``key``
        holds now (its reader asks for what follows the last one)."""
        [(last, _)] = await self.xrevrange(key, count=1)
        past = asyncio.Event()
        self._marks.append((key, entry_order(last), past))
        self.hearing.set()
        await past.wait()


@contextlib.asynccontextmanager
async def _workers(
    url: str, *, grace: float = 30.0, owner_client: type[Redis] = Redis, **options: Any
) -> AsyncIterator[
    tuple[tether.Registry, collections.Counter[str], tether.resume.Resume, tether.resume.Resume]
]:
    """The owner's registry and its ``on_abort`` books, the owner's and another
    worker's resumption (each its own client); both closed after."""
    aborts: collections.Counter[str] = collections.Counter()
    registry = tether.Registry(lambda rid: aborts.update([rid]))
    clients = [owner_client.from_url(url), Redis.from_url(url)]
    owner, other = (
        tether.resume.Resume(grace=grace, store=RedisStore(client, block=BLOCK), **options)
        for client in clients
    )
    try:
        yield registry, aborts, owner, other
    finally:
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        for client in clients:
            await client.aclose()


async def test_a_burst_of_opens_beyond_redis_maxclients_is_resumable_everywhere() -> None:
    # The client as the docs build it (a pool of 100); Redis takes 32 clients: the
    # store's writes must stay within its own bound, and an open that could not be
    # published at once must be published once Redis can take it.
    async with (
        redis_process(maxclients=32) as redis,
        _workers(redis.url) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        streams = [registry.open() for _ in range(120)]
        firsts = await asyncio.gather(*(owner.open(stream) for stream in streams))
        for stream in streams:
            registry.deliver(stream.rid, 0)
        for first in firsts:
            assert [output for _, output in await first.next_ready() or ()] == [0]
            await first.aclose()  # parked
        mirrors = [await _reach(other, first.token, 1) for first in firsts]
        for stream in streams:
            registry.deliver(stream.rid, 1, finished=True)
        for mirror in mirrors:
            assert await _drain(mirror) == [1]
            await mirror.aclose()
    assert registry.in_flight == 0
    assert aborts == {}


async def test_reconnects_waiting_for_future_events_hold_no_connection_from_other_streams(
    redis_proc: RedisProcess,
) -> None:
    # 150 reconnects naming an event the log will not hold for a while each wait (up
    # to 2 s) on the worker that serves them; a stream that worker owns meanwhile must
    # still be copied, and resumable on the first worker.
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        _, first = await _first_read(registry, owner)
        waits = [asyncio.create_task(other.follow(_point(first.token, 1000))) for _ in range(150)]
        victim = registry.open()
        own = await other.open(victim)
        for n in range(5):
            registry.deliver(victim.rid, n)
        registry.deliver(victim.rid, 5, finished=True)
        assert len(await _drain(own)) == 6
        elsewhere = await _reach(owner, own.token, 6)  # the end came through: the copy did
        assert await elsewhere.next_ready() is None
        started = time.monotonic()
        assert await asyncio.gather(*waits) == [None] * 150  # past every event: 404
        assert time.monotonic() - started < 5
        await elsewhere.aclose()
        await first.aclose()
    assert aborts.total() == 1  # the target, parked, aborted when the registry closed


async def test_two_reconnects_racing_on_one_worker_leave_the_tail_to_the_newer(
    redis_proc: RedisProcess,
) -> None:
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(20):
        stream, first = await _first_read(registry, owner, leave=True)
        await _reach(other, first.token, 1)  # (the copy is there)
        for round_ in range(5):
            a, b = await asyncio.gather(
                other.follow(_point(first.token, 1)), other.follow(_point(first.token, 1))
            )
            assert a is not None
            assert b is not None
            registry.deliver(stream.rid, f"tail{round_}")
            tail = [f"tail{r}" for r in range(round_ + 1)]
            results = await asyncio.gather(_drain_until(a, tail[-1]), _drain_until(b, tail[-1]))
            # One of them is the client now and gets the tail; the other ended quietly.
            assert ["replaced: client_disconnected"] in results, results
            assert tail in results, results
            await a.aclose()
            await b.aclose()
        registry.deliver(stream.rid, "end", finished=True)
        last = await _reach(other, first.token, 1)
        assert await _drain(last) == [*(f"tail{r}" for r in range(5)), "end"]
    assert registry.in_flight == 0
    assert aborts == {}


async def _drain_until(follower: Follower, last: str) -> list[Any]:
    """What a client reads up to ``last``, or ``["replaced"]`` when a newer client
    took the stream over."""
    seen: list[Any] = []
    try:
        while (items := await follower.next_ready()) is not None:
            seen += [output for _, output in items]
            if seen and seen[-1] == last:
                return seen
    except tether.Aborted as exc:
        return [f"replaced: {exc.reason.value}"]
    return seen


async def test_a_client_elsewhere_that_leaves_across_a_redis_restart_lets_the_owner_expire_it(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        _workers(redis_proc.url, grace=0.5) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        stream, first = await _first_read(registry, owner)
        mirror = await _reach(other, first.token, 1)
        with pytest.raises(tether.Aborted):  # the owner heard of the client elsewhere
            await first.next_ready()
        await redis_proc.kill()
        registry.deliver(stream.rid, 1)  # its copy fails: Redis is down
        await eventually(lambda: "writing to Redis failed" in caplog.text)
        await redis_proc.start()  # empty
        await mirror.aclose()  # the client leaves; its worker may not be able to say so
        # The owner parks it (the lease of that client is gone) and aborts it once its
        # grace period passed: nobody can reach it any more.
        await eventually(lambda: registry.in_flight == 0)
    assert aborts == {stream.rid: 1}


async def test_a_paused_redis_costs_a_request_its_timeout_and_a_503(
    redis_proc: RedisProcess,
) -> None:
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        _, first = await _first_read(registry, owner)
        await (await _reach(other, first.token, 1)).aclose()  # (it is in Redis)
        redis_proc.pause()
        try:
            started = time.monotonic()
            async with asyncio.timeout(5):
                answer = await other.reconnect({"last-event-id": f"{first.token}.1"}, {})
            assert isinstance(answer, tether.http.ErrorResponse)
            assert answer.status == 503
            assert answer.headers == {"retry-after": "1"}
            with pytest.raises(ConnectionError):
                async with asyncio.timeout(5):
                    await other.cancel(first.token)
            # A new resumable stream is served, resumable here until Redis answers.
            later = registry.open()
            async with asyncio.timeout(5):
                second = await owner.open(later)
            registry.deliver(later.rid, "x", finished=True)
            assert [output for _, output in await second.next_ready() or ()] == ["x"]
            await second.aclose()
            # A stream that needs no Redis is not even slowed down.
            plain = registry.open()
            registry.deliver(plain.rid, "y", finished=True)
            async with asyncio.timeout(0.5):
                assert await plain.result() == "y"
            assert time.monotonic() - started < 4  # three requests, each one timeout
        finally:
            redis_proc.resume()
        # Once Redis answers, the stream opened during the pause is resumable elsewhere.
        mirror = await _reach(other, second.token, 0)
        assert await _drain(mirror) == ["x"]
        await mirror.aclose()
    assert aborts.total() == 1  # the first stream, parked, aborted as the registry closed


async def test_stop_and_reconnects_elsewhere_survive_a_redis_restarted_empty(
    redis_proc: RedisProcess,
) -> None:
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        stream, first = await _first_read(registry, owner)
        await (await _reach(other, first.token, 1)).aclose()
        await redis_proc.restart()
        # Until the owner has published it again, a reconnect elsewhere is a 503 to
        # retry; never a 404 (a client would give up on a stream that lives).
        while True:
            try:
                again = await other.follow(_point(first.token, 1))
                break
            except ConnectionError:
                await asyncio.sleep(0.02)
        assert again is not None
        registry.deliver(stream.rid, 1)
        assert [output for _, output in await again.next_ready() or ()] == [1]
        await again.aclose()
        while True:  # Stop elsewhere reaches the owner
            try:
                stopped = await other.cancel(first.token)
                break
            except ConnectionError:
                await asyncio.sleep(0.02)
        assert stopped
        await eventually(lambda: registry.in_flight == 0)
    assert aborts == {stream.rid: 1}


async def test_the_log_in_redis_holds_about_max_bytes_as_the_owners_does(
    redis_proc: RedisProcess,
) -> None:
    async with (
        _workers(redis_proc.url, max_events=1000, max_bytes=10_000) as (
            registry,
            aborts,
            owner,
            other,
        ),
        asyncio.timeout(30),
    ):
        stream = registry.open()
        first = await owner.open(stream)
        for n in range(1, 101):  # 100 outputs of about 1 kB, each read at once
            registry.deliver(stream.rid, f"{n:04}" + "x" * 996)
            await first.next_ready()
        client = Redis.from_url(redis_proc.url)
        log = f"tether:resume:{first.token}:log"
        while True:  # (the owner's writer copies in its own time)
            last = await client.xrevrange(log, count=1)
            if last and last[0][1].get(b"n") == b"100":
                break
            await asyncio.sleep(0.01)
        held = sum(len(fields[b"d"]) for _, fields in await client.xrange(log))
        await client.aclose()
        assert 9_000 <= held <= 11_000
        assert await other.follow(_point(first.token, 50)) is None  # no longer held
        tail = await _reach(other, first.token, 95)
        assert [output[:4] for _, output in await tail.next_ready() or ()] == [
            f"{n:04}" for n in range(96, 101)
        ]
        await tail.aclose()
    assert aborts.total() == 1


async def test_a_parked_stream_outlives_its_grace_while_redis_keeps_its_client_out(
    redis_proc: RedisProcess,
) -> None:
    # The client can only come back through Redis; while Redis is paused it is refused
    # with 503s. Its grace period must not run out meanwhile: that would turn the
    # 503s it was told to retry into a 404 for a stream that existed.
    grace = 1.0
    async with (
        _workers(redis_proc.url, grace=grace) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        stream, first = await _first_read(registry, owner, leave=True)
        await (await _reach(other, first.token, 1)).aclose()  # in Redis; parked again
        channel = owner.store.channel(first.token)
        assert channel is not None
        await eventually(lambda: channel.timer is not None)  # its grace period runs
        redis_proc.pause()
        try:
            outage_ends = time.monotonic() + 1.3 * grace
            answer = await other.reconnect({"last-event-id": f"{first.token}.1"}, {})
            assert isinstance(answer, tether.http.ErrorResponse)
            assert answer.status == 503  # the client is told to retry
            # The outage lasts longer than the grace period (its length, not a wait).
            await asyncio.sleep(max(0.0, outage_ends - time.monotonic()))
        finally:
            redis_proc.resume()
        while True:
            try:
                back = await other.follow(_point(first.token, 1))
                break
            except ConnectionError:
                await asyncio.sleep(0.02)
        assert back is not None  # not a 404
        assert stream.rid not in aborts
        registry.deliver(stream.rid, 1, finished=True)
        assert await _drain(back) == [1]
        await back.aclose()
    assert aborts.total() == 0


async def test_a_reconnect_ahead_of_a_log_its_owner_cannot_copy_yet_is_told_to_retry(
    redis_proc: RedisProcess,
) -> None:
    # Redis answers, but the owner's copies cannot get through for longer than a
    # reconnect waits for the log to catch up (its copy slots are all taken, as by a
    # backlog of copies): the client's id is ahead of Redis, not unknown. A 404 would
    # make it give up on a stream that lives.
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        stream, first = await _first_read(registry, owner)
        await (await _reach(other, first.token, 1)).aclose()  # event 1 is in Redis
        assert isinstance(owner.store, RedisStore)
        slots = owner.store.upkeep_slots
        held = 0
        while not slots.locked():
            await slots.acquire()
            held += 1
        try:
            again = await owner.follow(_point(first.token, 1))
            assert again is not None
            registry.deliver(stream.rid, 2)
            registry.deliver(stream.rid, 3)
            assert [output for _, output in await again.next_ready() or ()] == [2, 3]
            await again.aclose()
            with pytest.raises(ConnectionError):  # a 503: retry
                await other.follow(_point(first.token, 3))
        finally:
            for _ in range(held):
                slots.release()
        back = await _reach(other, first.token, 3)
        registry.deliver(stream.rid, 4, finished=True)
        assert await _drain(back) == [4]
        await back.aclose()
    assert aborts.total() == 0


async def test_a_claim_from_a_reader_that_already_left_never_ends_a_newer_reader(
    redis_proc: RedisProcess,
) -> None:
    # A client elsewhere attaches (its claim is in the control stream) and leaves; then
    # one reconnects on the owner's worker. The owner hears that claim only after: it
    # is older than the owner's own (which every worker will hear after it), so the
    # newer reader reads on.
    async with (
        _workers(redis_proc.url, owner_client=_HardOfHearing) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        late = owner.store.client
        assert isinstance(owner.store, RedisStore)
        assert isinstance(late, _HardOfHearing)
        late.hearing.clear()  # (from the start: the owner has not heard its own claim either)
        stream, first = await _first_read(registry, owner)
        await (await _reach(other, first.token, 1)).aclose()
        again = await owner.follow(_point(first.token, 1))
        assert again is not None
        await late.heard_all_of(owner.store.key(first.token, "ctl"))
        registry.deliver(stream.rid, 2)
        registry.deliver(stream.rid, 3, finished=True)
        assert await _drain(again) == [2, 3]
    assert aborts.total() == 0


async def test_a_reader_that_left_before_its_claim_was_sent_ends_no_reader_elsewhere(
    redis_proc: RedisProcess,
) -> None:
    # A reconnect on the owner's worker leaves before its claim could be copied to
    # Redis (the owner's copies are held up); a client elsewhere then attaches. The
    # claim of the reader that left is never sent: it would end the newer one.
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        stream, first = await _first_read(registry, owner, leave=True)
        await (await _reach(other, first.token, 1)).aclose()  # event 1 is in Redis
        assert isinstance(owner.store, RedisStore)
        slots = owner.store.upkeep_slots
        held = 0
        while not slots.locked():
            await slots.acquire()
            held += 1
        try:
            gone = await owner.follow(_point(first.token, 1))
            assert gone is not None
            await gone.aclose()
            elsewhere = await _reach(other, first.token, 1)
            registry.deliver(stream.rid, 2)  # (copied after that claim, had it been sent)
        finally:
            for _ in range(held):
                slots.release()
        assert [output for _, output in await elsewhere.next_ready() or ()] == [2]
        registry.deliver(stream.rid, 3, finished=True)
        assert await _drain(elsewhere) == [3]
        await elsewhere.aclose()
    assert aborts.total() == 0


async def test_the_newest_claim_in_the_control_stream_wins_on_every_worker(
    redis_proc: RedisProcess,
) -> None:
    # Claims in this order: the owner's first reader, a reader elsewhere, a reconnect
    # on the owner's worker. The owner hears the middle one late, after its own first:
    # the newest still wins on both workers, and only one reader is left.
    async with (
        _workers(redis_proc.url, owner_client=_HardOfHearing) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        late = owner.store.client
        assert isinstance(owner.store, RedisStore)
        assert isinstance(late, _HardOfHearing)
        late.hearing.clear()
        stream, first = await _first_read(registry, owner)
        elsewhere = await _reach(other, first.token, 1)
        newest = await owner.follow(_point(first.token, 1))
        assert newest is not None
        await late.heard_all_of(owner.store.key(first.token, "ctl"))
        registry.deliver(stream.rid, 2)  # (copied after the newest claim)
        assert [output for _, output in await newest.next_ready() or ()] == [2]
        with pytest.raises(tether.Aborted, match="resumed elsewhere"):
            await _drain(elsewhere)
        registry.deliver(stream.rid, 3, finished=True)
        assert await _drain(newest) == [3]
    assert aborts.total() == 0


async def test_a_claim_said_again_after_a_newer_one_ends_no_reader(
    redis_proc: RedisProcess,
) -> None:
    # A claim is said again when Redis may have lost it (an owner publishes its stream
    # again; a client elsewhere whose lease lapsed tells the owner it is still there),
    # and that may land after a newer claim: it ends nobody, on either side.
    async with (
        _workers(redis_proc.url, owner_client=_HardOfHearing) as (registry, aborts, owner, other),
        asyncio.timeout(30),
    ):
        late = owner.store.client
        assert isinstance(owner.store, RedisStore)
        assert isinstance(other.store, RedisStore)
        assert isinstance(late, _HardOfHearing)
        stream, first = await _first_read(registry, owner)
        elsewhere = await _reach(other, first.token, 1)
        with pytest.raises(tether.Aborted, match="resumed elsewhere"):
            await first.next_ready()  # the owner heard the claim from elsewhere
        ctl = owner.store.key(first.token, "ctl")
        entries = await late.xrange(ctl)
        claims = [(entry_id, fields) for entry_id, fields in entries if fields[b"op"] == b"attach"]
        (mine, _), (theirs, their_fields) = claims
        # The owner's first claim, said again: the client elsewhere claimed after it.
        await late.xadd(ctl, {"op": "attach", "w": owner.store.worker, "c": mine})
        registry.deliver(stream.rid, 2)  # (copied after that)
        assert [output for _, output in await elsewhere.next_ready() or ()] == [2]
        newest = await owner.follow(_point(first.token, 2))
        assert newest is not None
        with pytest.raises(tether.Aborted, match="resumed elsewhere"):
            await _drain(elsewhere)  # (the newest claim is in Redis)
        await late.heard_all_of(ctl)  # (and the owner heard it)
        # The claim from elsewhere, said again: the reconnect here claimed after it.
        renewed = {"op": "attach", "w": other.store.worker, "f": their_fields[b"f"], "c": theirs}
        await late.xadd(ctl, renewed)  # type: ignore[arg-type]
        await late.heard_all_of(ctl)
        registry.deliver(stream.rid, 3, finished=True)
        assert await _drain(newest) == [3]
    assert aborts.total() == 0


async def test_hostile_resume_ids_elsewhere_are_a_404_that_costs_the_stream_nothing(
    redis_proc: RedisProcess,
) -> None:
    async with _workers(redis_proc.url) as (registry, aborts, owner, other), asyncio.timeout(30):
        stream, first = await _first_read(registry, owner, leave=True)
        await (await _reach(other, first.token, 1)).aclose()  # (it is in Redis)
        token = first.token
        hostile: list[tuple[dict[str, str], dict[str, str]]] = [
            ({"last-event-id": f"{token}.-1"}, {}),
            ({"last-event-id": f"{token}.1e3"}, {}),
            ({"last-event-id": f"{token}.{'9' * 100}"}, {}),  # (longer than any id)
            ({"last-event-id": f"{token}.\u0661"}, {}),  # an Arabic-Indic digit
            ({"last-event-id": "x" * 100_000}, {}),
            ({"tether-resume-token": "x" * 100_000}, {}),
            ({"tether-resume-token": "é" * 22}, {}),
            ({"tether-resume-token": "ü:meta"}, {}),
            ({"tether-resume-token": f"{token}:meta"}, {}),
            ({}, {"resume_token": "\ud800\udfff\udc80"}),  # lone surrogates, from a query
            ({}, {"last_event_id": f"\udc80{token}.1"}),
            ({"tether-resume-token": token}, {"last_event_id": f"{token[::-1]}.1"}),
        ]
        for headers, query in hostile:
            answer = await other.reconnect(headers, query)
            assert answer is tether.resume.NOT_RESUMABLE, (headers, query, answer)
        # An id far past every event: a 404 once the wait for the owner's writes is over.
        answer = await other.reconnect({"last-event-id": f"{token}.{10**30}"}, {})
        assert answer is tether.resume.NOT_RESUMABLE
        # None of it touched the stream: it resumes elsewhere, whole.
        back = await _reach(other, token, 1)
        registry.deliver(stream.rid, 2, finished=True)
        assert await _drain(back) == [2]
        await back.aclose()
    assert aborts.total() == 0


@dataclasses.dataclass
class _CutOff:
    """Two workers whose owner reaches Redis as a user of its own, that ``admin`` may
    deny every command (the owner alone then cannot reach Redis); grace 0.5 s."""

    admin: Redis
    registry: tether.Registry
    aborts: collections.Counter[str]
    stores: list[RedisStore]
    owner: tether.resume.Resume
    other: tether.resume.Resume

    async def read_elsewhere(self) -> tuple[tether.Stream, Follower, tether.resume.Channel]:
        """A stream of the owner's, its client on the other worker (the owner heard of
        it), and the owner's record of it."""
        stream, first = await _first_read(self.registry, self.owner)
        mirror = await _reach(self.other, first.token, 1)
        channel = self.stores[0].channel(first.token)
        assert channel is not None
        await eventually(lambda: channel.remote)
        return stream, mirror, channel

    async def finish_read_by(self, stream: tether.Stream, mirror: Follower) -> None:
        """The stream's last outputs reach its client elsewhere, every one."""
        self.registry.deliver(stream.rid, 1)
        self.registry.deliver(stream.rid, 2, finished=True)
        assert await _drain(mirror) == [1, 2]
        await mirror.aclose()

    async def deny(self, denied: bool) -> None:
        rule = "-@all" if denied else "+@all"
        await self.admin.execute_command("ACL", "SETUSER", "owner", rule)


@contextlib.asynccontextmanager
async def _owner_cut_off(redis_proc: RedisProcess) -> AsyncIterator[_CutOff]:
    admin = Redis.from_url(redis_proc.url)
    await admin.execute_command("ACL", "SETUSER", "owner", "on", ">secret", "~*", "&*", "+@all")
    host = redis_proc.url.split("://", 1)[1]
    clients = [Redis.from_url(f"redis://owner:secret@{host}"), Redis.from_url(redis_proc.url)]
    aborts: collections.Counter[str] = collections.Counter()
    registry = tether.Registry(lambda rid: aborts.update([rid]))
    stores = [RedisStore(client, block=BLOCK) for client in clients]
    owner, other = (tether.resume.Resume(grace=0.5, store=store) for store in stores)
    try:
        yield _CutOff(admin, registry, aborts, stores, owner, other)
    finally:
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        for client in [*clients, admin]:
            await client.aclose()


async def test_a_client_elsewhere_whose_lease_redis_lost_tells_the_owner_it_is_still_there(
    redis_proc: RedisProcess,
) -> None:
    # The owner alone cannot reach Redis (it parks the stream whose client's lease it
    # cannot see) while the worker of that client renews its lease in a Redis that lost
    # everything, its owner's keys too.
    async with _owner_cut_off(redis_proc) as cut, asyncio.timeout(30):
        registry, admin = cut.registry, cut.admin
        stream, mirror, channel = await cut.read_elsewhere()
        lease = cut.stores[1].key(channel.token, "lease")
        assert await admin.exists(lease)
        await cut.deny(True)
        await admin.flushall()  # (as a restart empty does)
        await eventually(lambda: not channel.remote)  # no lease seen: parked
        await eventually(lambda: admin.exists(lease))  # renewed, by a client still there
        await cut.deny(False)
        # The owner publishes the stream again and hears of its client again (its
        # lease is there, but the owner had parked the stream meanwhile).
        await eventually(lambda: channel.remote)
        await cut.finish_read_by(stream, mirror)
    assert registry.in_flight == 0
    assert cut.aborts == {}


async def test_an_owner_cut_off_from_redis_alone_hears_again_of_its_client_elsewhere(
    redis_proc: RedisProcess,
) -> None:
    # The owner alone cannot reach Redis for a while, and parks the stream whose
    # client's lease it cannot see, while that client's worker renews its lease all
    # along (so it has nothing to tell again). Promised (docs/resume.md): "nothing a
    # shared store does keeps alive a request that no client can reach beyond its grace
    # period", and no more: once the owner reaches Redis again and finds the lease
    # held, the stream is that client's again; its grace period (0.5 s) must not abort
    # it under the client still reading.
    async with _owner_cut_off(redis_proc) as cut, asyncio.timeout(30):
        registry = cut.registry
        stream, mirror, channel = await cut.read_elsewhere()
        await cut.deny(True)
        await eventually(lambda: not channel.remote)  # no lease seen: parked
        await cut.deny(False)
        await eventually(lambda: channel.remote, timeout=3.0)  # its lease: held
        await cut.finish_read_by(stream, mirror)
    assert registry.in_flight == 0
    assert cut.aborts == {}


async def test_a_redis_that_evicts_under_maxmemory_never_strands_a_reconnect(
    redis_proc: RedisProcess,
) -> None:
    # A real eviction: Redis capped at a few MB above what it holds (allkeys-lru, as a
    # cache is run) while other data keeps coming, so that it evicts keys of the store's
    # too, whichever its sampling picks. Promised (docs/resume.md): "keys that Redis
    # lost (restarted empty, evicted) make the owner publish the stream again"; every
    # command is bounded; "absence is claimed only when it is proven". So each
    # reconnect elsewhere meanwhile answers within a bound and either resumes (in
    # order, exactly once) or is told to retry (503), never that a live stream is
    # unknown (404); once the pressure passes, the owner has published the whole
    # stream again and a reconnect resumes.
    admin = Redis.from_url(redis_proc.url)
    answers: collections.Counter[str] = collections.Counter()
    evictions = 0  # how often the stream's keys were found evicted
    try:
        async with (
            _workers(redis_proc.url) as (registry, aborts, owner, other),
            asyncio.timeout(45),
        ):
            stream, first = await _first_read(registry, owner, leave=True)
            keys = [f"tether:resume:{first.token}:{kind}" for kind in ("log", "ctl", "meta")]
            await eventually(lambda: _exist(admin, keys))
            used = (await admin.info("memory"))["used_memory"]
            await admin.config_set("maxmemory-policy", "allkeys-lru")
            await admin.config_set("maxmemory", str(used + 2_000_000))
            delivered, fillers = 1, 0
            while evictions < 8 and fillers < 600:
                for _ in range(3):  # (192 KB of other data, kept with no expiry)
                    await admin.set(f"other:{fillers}", b"x" * 65_536)
                    fillers += 1
                registry.deliver(stream.rid, delivered)
                delivered += 1
                answers[await _reconnect_from(other, first.token, 1, delivered)] += 1
                if await _exist(admin, keys):
                    continue
                evictions += 1

                async def answered_then_held(count: int = delivered) -> bool:
                    answers[await _reconnect_from(other, first.token, 1, count)] += 1
                    return await _exist(admin, keys)

                # Reconnects until the owner has published it again, Redis still full.
                try:
                    await eventually(answered_then_held, timeout=5.0)
                except TimeoutError:
                    pytest.fail(f"the owner did not publish its evicted stream again: {answers}")
            evicted = (await admin.info("stats"))["evicted_keys"]
            assert evicted > 0, "Redis evicted nothing: the test tested nothing"
            assert evictions, f"Redis never evicted the stream's keys ({evicted} others)"
            await admin.config_set("maxmemory", "0")  # the pressure passes
            numbers = list(range(1, delivered + 1))  # (the log's event numbers: 1-based)

            async def published_whole() -> bool:
                held = [int(fields[b"n"]) for _, fields in await admin.xrange(keys[0])]
                return held == numbers and await _exist(admin, keys)

            await eventually(published_whole, timeout=5.0)
            after: list[str] = []

            async def answered() -> bool:  # (503s while the owners mark Redis settling)
                after.append(await _reconnect_from(other, first.token, 1, delivered))
                return after[-1] != "503"

            await eventually(answered, timeout=5.0)
            assert after[-1] == "resumed", f"after the pressure passed: {after}"
            assert aborts == {}
    finally:
        await admin.aclose()
    assert "hang" not in answers, answers
    assert set(answers) <= {"resumed", "503", "ended"}, answers


async def _exist(redis: Redis, keys: list[str]) -> bool:
    return bool(await redis.exists(*keys) == len(keys))


async def _reconnect_from(other: tether.resume.Resume, token: str, last: int, count: int) -> str:
    """How a reconnect on ``other``'s worker that saw ``last`` outputs of ``count``
    ends, each step bounded: ``resumed`` (the rest, in order, once), ``503``, ``404``,
    ``ended`` (an error after outputs in order), ``out of order``, or ``hang``."""
    try:
        async with asyncio.timeout(3.0):
            follower = await other.follow(_point(token, last))
    except ConnectionError:
        return "503"
    except TimeoutError:
        return "hang"
    if follower is None:
        return "404"
    seen: list[Any] = []
    outcome = "hang"
    try:
        async with asyncio.timeout(3.0):
            while len(seen) < count - last and (items := await follower.next_ready()):
                seen += [output for _, output in items]
            outcome = "resumed"
    except tether.TetherError:
        outcome = "ended"
    except TimeoutError:
        pass
    finally:
        await follower.aclose()
    if seen != list(range(last, last + len(seen))):
        return "out of order"
    return outcome if len(seen) == count - last or outcome != "resumed" else "short"
