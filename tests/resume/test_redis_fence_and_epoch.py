"""RedisStore's fence (every owner write one script that does nothing once the
goodbye's ``<token>:end`` mark is set), the judge's PING in an upkeep slot, and the
settling mark a store sets when it finds no epoch: each scene one promise of
docs/resume.md, against a real ``redis-server`` the test starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Final

import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore

import tether
import tether.resume
from tests._support.redis_server import RedisProcess
from tests._support.redis_server import redis_proc as redis_proc
from tether.resume import Follower, ResumePoint, resume_point
from tether.types import OnAbort

from .conftest import eventually

pytestmark = pytest.mark.timeout(60)

BOUND: Final = 15.0
BLOCK: Final = 0.1


def _point(token: str, last: int) -> ResumePoint:
    point = resume_point(f"{token}.{last}", None)
    assert point is not None
    return point


async def _unknown(resume: tether.resume.Resume, point: ResumePoint) -> bool:
    """A reconnect with ``point`` is a 404 (not a 503 to retry)."""
    try:
        follower = await resume.follow(point)
    except ConnectionError:
        return False
    if isinstance(follower, Follower):
        await follower.aclose()
        return False
    return True


async def test_a_wrong_token_on_a_new_redis_is_a_404_after_settling_though_no_stream_ran(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): "on a new Redis too a wrong token is a 503 for the
    # first 3 x block + timeout", then a 404. A first deploy: workers start on a Redis
    # new to tether, and the first request one gets is a reconnect with a token that
    # is wrong (an old bookmark, a client of a previous deployment) before any stream
    # was opened anywhere. No store sets the epoch until a stream runs (the reader and
    # its upkeep start with the first stream), so every such reconnect is a 503 for
    # as long as no stream runs, not for a settling period.
    await redis_proc.restart()  # (empty: new to tether)
    client = Redis.from_url(redis_proc.url)
    store = RedisStore(client, block=BLOCK, timeout=0.2)
    resume = tether.resume.Resume(grace=30.0, store=store)
    point = _point(tether.resume.new_token(), 1)
    try:
        async with asyncio.timeout(BOUND):
            with contextlib.suppress(ConnectionError):
                await resume.follow(point)  # (the first: a 503 is fair)
            settle = store.settle_ms / 1000
            try:
                await eventually(lambda: _unknown(resume, point), timeout=settle + 3.0)
            except TimeoutError:
                epoch = await client.exists(store.epoch)
                pytest.fail(
                    f"a wrong token on a new Redis is still a 503 after {settle + 3.0:g} s "
                    f"(a settling period is {settle:g} s; epoch key set: {bool(epoch)})"
                )
    finally:
        await resume.aclose()
        await client.aclose()


async def test_a_worker_whose_redis_user_may_not_run_scripts_leaves_other_workers_free_to_say_404(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # Promised (docs/resume.md): an ACL user needs `+@scripting` (managed Redis often
    # grants less), and a wrong token is a 404 once Redis is not settling. A worker
    # deployed with a user that may not run scripts: Redis answers it (PING, the
    # reader, the upkeep), but every write of its owners (EVALSHA) is refused. Nothing
    # says so at start; each stream logs "writing to Redis failed ... until Redis
    # answers again" (it does answer), and its upkeep marks Redis *settling* every
    # block period for as long as any such stream runs: on every other worker, correctly
    # configured, every wrong token is a 503 for ever, never a 404.
    point = _point(tether.resume.new_token(), 1)
    async with _denied(redis_proc, "noscript", "-@scripting") as (
        admin,
        registry,
        stores,
        owner,
        other,
    ):
        with caplog.at_level(logging.WARNING, logger="tether.redis"):
            stream = registry.open()
            here = await owner.open(stream)
            registry.deliver(stream.rid, 0)
            await _a_404_after_settling(admin, stores[1], other, point, caplog)
            await here.aclose()


async def test_a_live_stream_survives_a_script_flush(redis_proc: RedisProcess) -> None:
    # Promised (docs/resume.md): a reconnect elsewhere follows the live stream, every
    # event in order, exactly once; Redis is never trusted to keep what it was told
    # (its script cache included: SCRIPT FLUSH, a restart, a failover to a replica).
    from .test_redis_faults import _drain, _first_read, _reach, _workers

    admin = Redis.from_url(redis_proc.url)
    try:
        async with (
            _workers(redis_proc.url) as (registry, aborts, owner, other),
            asyncio.timeout(BOUND),
        ):
            stream, _first = await _first_read(registry, owner, leave=True)
            mirror = await _reach(other, _first.token, 1)
            for n in range(1, 30):
                await admin.script_flush()
                registry.deliver(stream.rid, n, finished=n == 29)
            assert await _drain(mirror) == list(range(1, 30))
            await mirror.aclose()
            assert aborts == {}
    finally:
        await admin.aclose()


async def test_a_wrong_token_is_a_404_on_a_deployment_that_ran_no_stream_for_a_day(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): a wrong token is a 404 (a 503 only while Redis may
    # lack live streams). The epoch key lives a day and is renewed only by a store's
    # upkeep, which runs only while the store follows some stream: on a deployment
    # that ran no stream for a day (a quiet night and weekend, a staging site) it
    # expires, and from then on every wrong token, on every worker, is a 503 (an
    # EventSource retries it for ever) until some stream is opened somewhere. Its
    # natural expiry is played here by giving it a millisecond left.
    client = Redis.from_url(redis_proc.url)
    store = RedisStore(client, block=BLOCK, timeout=0.2)
    resume = tether.resume.Resume(grace=30.0, store=store)
    point = _point(tether.resume.new_token(), 1)
    try:
        async with asyncio.timeout(BOUND):
            assert await _unknown(resume, point)  # (a day's idle starts: a 404)
            assert await client.pexpire(store.epoch, 1)  # ... a day later
            await eventually(lambda: _no_epoch(client, store))
            settle = store.settle_ms / 1000
            try:
                await eventually(lambda: _unknown(resume, point), timeout=settle + 3.0)
            except TimeoutError:
                pytest.fail(f"a wrong token is still a 503 after {settle + 3.0:g} s")
    finally:
        await resume.aclose()
        await client.aclose()


async def _no_epoch(client: Redis, store: RedisStore) -> bool:
    return not await client.exists(store.epoch)


async def test_the_silence_verdict_comes_within_timeout_though_every_upkeep_slot_is_stuck(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): after the loop was held, the verdict waits for one
    # fresh PING to go unanswered, "at most `timeout` more, once, its wait for one of
    # the upkeep's slots included". Redis pauses; the owner's one upkeep slot
    # (connections=2) is held by copies and renewals stuck on it; a blocking handler
    # holds the loop over the moment the silence is judged. The owner must park the
    # stream whose client is elsewhere within `timeout` (and a margin) of the loop's
    # release, not behind the stuck commands.
    import time

    from .test_redis_faults import _first_read, _InFlight, _reach

    owner_client = _InFlight.from_url(redis_proc.url)
    assert isinstance(owner_client, _InFlight)
    other_client = Redis.from_url(redis_proc.url)
    owner_store = RedisStore(owner_client, block=BLOCK, timeout=1.0, connections=2)
    other_store = RedisStore(other_client, block=BLOCK)
    owner = tether.resume.Resume(grace=30.0, store=owner_store)
    other = tether.resume.Resume(grace=30.0, store=other_store)
    registry = tether.Registry()
    try:
        async with asyncio.timeout(30):
            stream, first = await _first_read(registry, owner, leave=True)
            mirror = await _reach(other, first.token, 1)
            channel = owner_store.channel(first.token)
            assert channel is not None
            await eventually(lambda: channel.remote)
            redis_proc.pause()
            for n in range(1, 4):
                registry.deliver(stream.rid, n)  # (copies: the upkeep's one slot)
            await eventually(lambda: owner_store.upkeep_slots.locked())
            time.sleep(2 * owner_store.lease_ms / 1000)  # noqa: ASYNC251 (the fault)
            loop = asyncio.get_running_loop()
            released = loop.time()
            await eventually(lambda: not channel.remote, timeout=10.0)
            took = loop.time() - released
            assert took <= owner_store.timeout + 0.5, f"parked {took:.2f} s after the loop"
            await mirror.aclose()
    finally:
        redis_proc.resume()
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        await owner_client.aclose()
        await other_client.aclose()


async def test_a_late_renewal_does_not_make_a_stopped_stream_live_again_on_a_redis_that_evicts(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): the goodbye's mark fences every late write of the
    # owner's; "a write that Redis holds on to for longer than the grace period and a
    # minute finds no mark; it is the one case left". It is not: the mark is a key that
    # nothing reads (a late write's EXISTS touches nothing), the first one a Redis that
    # evicts by use (`allkeys-lfu`, as a cache is run) picks, before the stream's own
    # keys that were written to all along. A renewal sent before a Stop lands after the
    # goodbye and a burst of memory pressure that evicted the mark: the log and control
    # stream live the grace period and a minute again with no meta (a live stream whose
    # meta Redis lost, to every worker: 503s and Stop "known" for ~90 s).
    from .test_redis_faults import _first_read, _gone, _late_owner, _reach, _renewal

    async with _late_owner(redis_proc, timeout=5.0) as (registry, late, admin, stores, resumes):
        owner, other = resumes
        await admin.config_set("maxmemory-policy", "allkeys-lfu")  # (from the start)
        stream, first = await _first_read(registry, owner, leave=True)
        for n in range(1, 41):  # (the stream's keys, used all along)
            registry.deliver(stream.rid, n)
        await (await _reach(other, first.token, 40)).aclose()  # (it is in Redis)
        log, meta, mark = (stores[0].key(first.token, kind) for kind in ("log", "meta", "end"))
        late.matches = _renewal
        await late.held.wait()  # the renewal is on its way, late
        assert await owner.cancel(first.token)  # Stop, on the owner
        await eventually(lambda: not stores[0]._writers)  # noqa: SLF001 (its goodbye went out)
        assert await _gone(admin, meta, log)
        # A burst of memory pressure (other data, as a shared Redis holds).
        used = (await admin.info("memory"))["used_memory"]
        await admin.config_set("maxmemory", str(used + 1_000_000))
        batches = 0
        while await admin.exists(mark) and batches < 60:  # (within the second keys linger)
            async with admin.pipeline(transaction=False) as pipe:
                for one in range(8):
                    pipe.set(f"cache:{batches}:{one}", b"x" * 65_536)
                await pipe.execute()
            batches += 1
        await admin.config_set("maxmemory", "0")  # the pressure passes
        assert not await admin.exists(mark), "Redis evicted no mark: the test tested nothing"
        late.go.set()
        await late.done.wait()  # the late renewal landed
        assert await admin.exists(log), "Redis evicted the log too: the test tested nothing"
        assert await admin.pttl(log) <= 1000, "the stopped stream's log lives on"


async def test_a_worker_whose_redis_user_may_not_run_scripts_serves_its_streams_on_every_worker(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # Promised (docs/resume.md): without `+@scripting` the owner's writes are fenced by a
    # transaction watching the mark (a WARNING names the permission, once): its streams
    # resume on every worker, every event in order, and are over everywhere once stopped.
    from .test_redis_faults import _drain, _gone, _reach

    async with _denied(redis_proc, "noscript2", "-@scripting", timeout=1.0) as denied:
        admin, registry, stores, owner, other = denied
        with caplog.at_level(logging.WARNING, logger="tether.redis"):
            stream = registry.open()
            here = await owner.open(stream)
            registry.deliver(stream.rid, 0)
            assert [output for _, output in await here.next_ready() or ()] == [0]
            await here.aclose()
            mirror = await _reach(other, here.token, 1)
            for n in range(1, 20):
                registry.deliver(stream.rid, n, finished=n == 19)
            assert await _drain(mirror) == list(range(1, 20))
            await mirror.aclose()
            log, meta = (stores[0].key(here.token, kind) for kind in ("log", "meta"))
            assert await owner.cancel(here.token)  # (forgotten: its goodbye goes out)
            await eventually(lambda: _gone(admin, meta, log))
        warned = [r.getMessage() for r in caplog.records if "+@scripting" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]


async def test_a_worker_whose_redis_user_may_not_write_leaves_other_workers_free_to_say_404(
    redis_proc: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    # Promised (docs/resume.md): a command Redis refuses to a store's ACL user (NOPERM)
    # is a misconfiguration, not an outage: the owner logs it (naming what was refused),
    # serves its stream resumable on its own worker only, and never marks Redis
    # settling for it; every other worker's wrong token is a 404 after a settling period.
    point = _point(tether.resume.new_token(), 1)
    rules = ("-@scripting", "-@transaction")
    async with _denied(redis_proc, "nowrite", *rules) as (admin, registry, stores, owner, other):
        upkeeps = _count_upkeeps(stores[0])
        with caplog.at_level(logging.WARNING, logger="tether.redis"):
            stream = registry.open()
            here = await owner.open(stream)
            registry.deliver(stream.rid, 0)
            await _a_404_after_settling(admin, stores[1], other, point, caplog)
            # ... and stays one (the owner keeps trying, and is refused, each period)
            for seen in range(upkeeps[0], upkeeps[0] + 5):
                await eventually(lambda seen=seen: upkeeps[0] > seen)
                assert await _unknown(other, point)
            refused = [r.getMessage() for r in caplog.records if "'watch'" in r.getMessage()]
            assert refused, [r.getMessage() for r in caplog.records]
            await here.aclose()


async def _a_404_after_settling(
    admin: Redis,
    store: RedisStore,
    resume: tether.resume.Resume,
    point: ResumePoint,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reconnect with ``point`` through ``resume`` is a 404 within a settling period
    (and a margin)."""
    settle = store.settle_ms / 1000
    try:
        await eventually(lambda: _unknown(resume, point), timeout=settle + 3.0)
    except TimeoutError:
        settling = await admin.pttl(store.settling)
        logged = [record.getMessage() for record in caplog.records]
        pytest.fail(
            f"a wrong token elsewhere is still a 503 after {settle + 3.0:g} s "
            f"(Redis marked settling, {settling} ms left); logged: {logged}"
        )


@contextlib.asynccontextmanager
async def _denied(
    redis_proc: RedisProcess,
    user: str,
    *rules: str,
    timeout: float = 0.2,
    owner_denied: bool = True,
    on_abort: OnAbort | None = None,
) -> AsyncIterator[
    tuple[Redis, tether.Registry, list[RedisStore], tether.resume.Resume, tether.resume.Resume]
]:
    """An admin client, a registry (``on_abort`` its hook), and two workers' stores and
    resumptions, the owner's first: one reaches Redis as ACL ``user``, denied what
    ``rules`` take away (the owner's, unless not ``owner_denied``); the other with
    every right."""
    from .test_redis_faults import _as_user

    admin = Redis.from_url(redis_proc.url)
    clients = [await _as_user(admin, redis_proc, user, *rules), Redis.from_url(redis_proc.url)]
    if not owner_denied:
        clients.reverse()
    stores = [RedisStore(c, block=BLOCK, timeout=timeout) for c in clients]
    owner, other = (tether.resume.Resume(grace=30.0, store=store) for store in stores)
    registry = tether.Registry(on_abort)
    try:
        async with asyncio.timeout(BOUND):
            yield admin, registry, stores, owner, other
    finally:
        await registry.close(drain_timeout=0)
        await other.aclose()
        await owner.aclose()
        for c in (*clients, admin):
            await c.aclose()


def _count_upkeeps(store: RedisStore) -> list[int]:
    """How many upkeeps ``store``'s reader ran (from now on)."""
    count = [0]
    upkeep = store.ear._upkeep_store  # noqa: SLF001 (the count is the test's clock)

    async def counted() -> None:
        count[0] += 1
        await upkeep()

    store.ear._upkeep_store = counted  # noqa: SLF001
    return count
