"""RedisStore's fence as a transaction (a Redis user without ``+@scripting``: ``WATCH``
the stream's mark and meta, then ``MULTI``/``EXEC``): each scene one promise of
docs/resume.md, against a real ``redis-server`` the test starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

import tether
import tether.resume
from tests._support.redis_server import RedisProcess
from tests._support.redis_server import redis_proc as redis_proc

from .conftest import eventually
from .test_redis_faults import _first_read, _reach
from .test_redis_fence_and_epoch import _denied, _point, _unknown

pytestmark = pytest.mark.timeout(60)


async def test_a_busy_stream_on_a_user_without_scripting_leaves_its_worker_free_to_say_404(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): an ACL user without +@scripting "gets the same fence
    # as a transaction ... at the cost of 3 or 4 round trips per write"; a worker is
    # wary (every unknown token a 503) only once Redis failed it. A stream whose
    # producer is busy copies back to back; each copy's EXEC renews the meta that the
    # upkeep's renewal WATCHes, so the renewal loses its 8 tries in a row, gives up
    # ("the stream's keys changed under every try of a write"), and that give-up is
    # taken for Redis failing: the owner's worker is wary, its wrong tokens 503s,
    # while Redis answered every command at once.
    wrong = _point(tether.resume.new_token(), 1)
    async with _denied(redis_proc, "noscript", "-@scripting", timeout=1.0) as (
        _admin,
        registry,
        stores,
        owner,
        other,
    ):
        stream, first = await _first_read(registry, owner, leave=True)
        mirror = await _reach(other, first.token, 1)
        read: list[Any] = []

        async def drain() -> None:
            while (items := await mirror.next_ready()) is not None:
                read.extend(output for _, output in items)

        reader = asyncio.create_task(drain())
        loop = asyncio.get_running_loop()
        wary_seen, n, until = 0, 1, loop.time() + 30 * stores[0].block_ms / 1000
        while loop.time() < until:
            registry.deliver(stream.rid, n)
            n += 1
            wary_seen += stores[0].wary()
            await asyncio.sleep(0)  # (a yield: the producer is busy, it waits on nothing)
        wary = stores[0].wary()
        wrong_is_404 = await _unknown(owner, wrong)
        registry.deliver(stream.rid, n, finished=True)
        await reader
        assert read == list(range(1, n + 1))
        assert (wary, wary_seen, wrong_is_404) == (False, 0, True), (
            f"Redis answered every command, yet the owner's worker was wary on {wary_seen} "
            f"of {n} turns (now: {wary}; a wrong token a 404 there: {wrong_is_404})"
        )


async def test_a_reconnect_on_a_worker_whose_redis_user_may_not_xread_is_a_503_not_a_hang(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): "A command Redis refuses to the store's user (NOPERM
    # ...) is a misconfiguration, not an outage: the request that needed it is a 503
    # (StoreRefused ...) and the owner logs an ERROR naming the command". A worker
    # whose user may not block (-@blocking, as managed Redis and proxies often deny):
    # its one reader's XREAD is refused, taken for an outage ("Redis failed ...;
    # retrying", a WARNING) and retried for ever. A reconnect there reads the backlog
    # (XRANGE is allowed), claims the stream, renews its lease, and then waits on
    # pings for ever: the owner's events never reach it, no 503 is ever answered.
    async with _denied(redis_proc, "u", "-@blocking", owner_denied=False) as (
        _admin,
        registry,
        _stores,
        owner,
        other,
    ):
        stream, first = await _first_read(registry, owner, leave=True)
        try:
            mirror = await _reach(other, first.token, 1)
        except ConnectionError:
            return  # a 503: as promised
        for n in range(1, 4):
            registry.deliver(stream.rid, n)
        read: list[Any] = []
        try:
            async with asyncio.timeout(3.0):
                while len(read) < 3:
                    items = await mirror.next_ready()
                    assert items is not None
                    read += [output for _, output in items]
        except TimeoutError:
            pytest.fail(
                "a reconnect on a worker whose Redis user may not XREAD followed the "
                f"stream and read {read} of [1, 2, 3] in 3 s, with no 503"
            )
        except ConnectionError:
            pass  # (a 503 while following: fair)
        await mirror.aclose()


async def _script_runs(admin: Redis) -> int:
    """How many scripts Redis ran by their digest (``EVALSHA``) so far."""
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_an_owner_whose_user_is_granted_scripting_goes_back_to_one_round_trip_a_write(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md, and DESIGN Invariant 14: "no failure state is permanent
    # while it can recover"): every write of an owner's is one script; a user without
    # +@scripting gets the fence as a transaction "at the cost of 3 or 4 round trips per
    # write instead of 1". The first refused EVALSHA switches the store to the
    # transaction for good: once the operator grants +@scripting (the WARNING told
    # them to), every write still costs a WATCH, two reads and a MULTI/EXEC, for as
    # long as the worker runs.
    async with _denied(redis_proc, "noscript", "-@scripting") as (
        admin,
        registry,
        _stores,
        owner,
        _other,
    ):
        stream, _first = await _first_read(registry, owner, leave=True)
        await admin.execute_command("ACL", "SETUSER", "noscript", "+@scripting")
        before = await _script_runs(admin)
        delivered = [1]

        async def a_write_runs_the_script() -> bool:
            registry.deliver(stream.rid, delivered[0])
            delivered[0] += 1
            return await _script_runs(admin) > before

        try:
            await eventually(a_write_runs_the_script, timeout=3.0)
        except TimeoutError:
            pytest.fail(
                f"{delivered[0] - 1} events copied after +@scripting was granted, none by "
                "the script (each a watched transaction)"
            )


async def test_a_client_elsewhere_of_a_stream_stopped_on_its_owner_ends_cancelled(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): Stop, `await RESUME.cancel(token)`: "aborted at once
    # (reason cancelled); the client ends". The client reads on another worker; the
    # Stop endpoint runs on the owner's (the token's own). MemoryStore.cancel forgets
    # the channel at once, and the abort's end reaches it a step later: the writer's
    # goodbye has gone out with no end entry, and no writer is left to copy it. The
    # client elsewhere reads no end, the keys go, and it ends as if the owner died
    # ("the worker that ran this request is gone", reason server), not stopped.
    from .test_redis_faults import _drain, _workers

    async with _workers(redis_proc.url) as (registry, aborts, owner, other):
        stream, first = await _first_read(registry, owner, leave=True)
        mirror = await _reach(other, first.token, 1)
        registry.deliver(stream.rid, 1)
        assert [output for _, output in await mirror.next_ready() or ()] == [1]
        assert await owner.cancel(first.token)  # Stop, on the owner
        with pytest.raises(tether.Aborted) as ended:
            await _drain(mirror)
        assert ended.value.reason is tether.AbortReason.CANCELLED, (
            f"a client elsewhere of a stream stopped on its owner ended {ended.value!r} "
            f"(reason {ended.value.reason.value})"
        )
        assert sum(aborts.values()) == 1
        await mirror.aclose()


async def test_a_stop_elsewhere_reaches_an_owner_whose_redis_user_may_not_xread_or_is_a_503(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): Stop "aborted at once"; it travels on the control
    # stream, which the owner's one reader watches, "so ... Stop reaches it within one
    # round trip"; a command Redis refuses is a 503 for the request that needed it. An
    # owner whose user may not block (-@blocking): its XREAD is refused and retried for
    # ever (a WARNING, "Redis failed"), its writes go through. A Stop on another worker
    # posts to the control stream, answers "known", and the stream runs on: nobody
    # reads that control stream.
    aborted: list[str] = []
    async with _denied(redis_proc, "u", "-@blocking", on_abort=aborted.append) as (
        _admin,
        registry,
        _stores,
        owner,
        other,
    ):
        _stream, first = await _first_read(registry, owner, leave=True)
        await (await _reach(other, first.token, 1)).aclose()  # (it is in Redis)
        try:
            stopped = await other.cancel(first.token)
        except ConnectionError:
            return  # a 503: as promised
        assert stopped
        try:
            await eventually(lambda: bool(aborted), timeout=3.0)
        except TimeoutError:
            pytest.fail("a Stop elsewhere answered 'known' and the stream ran on for 3 s")


async def test_a_client_elsewhere_reads_the_end_of_a_stream_whose_meta_redis_just_evicted(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md): a client elsewhere reads the stream's end (a request
    # aborted: its reason); an owner's last copy, the end, "is worth a log of its own if
    # Redis lost the log (the clients elsewhere read the end there)" (_Writer._flush).
    # Redis evicts the stream's meta (a small hash nobody reads), then the request is
    # aborted (its deadline) before the owner's next renewal notices: the goodbye's
    # copy of the end now needs the meta, runs nowhere, and the goodbye deletes the
    # keys anyway. The client elsewhere reads no end: "the worker that ran this
    # request is gone" (server), never its deadline.
    from .test_redis_faults import _drain, _workers

    admin = Redis.from_url(redis_proc.url)
    try:
        async with _workers(redis_proc.url) as (registry, _aborts, owner, other):
            stream, first = await _first_read(registry, owner, leave=True)
            mirror = await _reach(other, first.token, 1)
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await mirror.next_ready() or ()] == [1]
            await admin.delete(f"tether:resume:{first.token}:meta")  # (evicted)
            registry.abort(stream.rid, tether.AbortReason.TIMEOUT)
            with pytest.raises(tether.Aborted) as ended:
                await _drain(mirror)
            assert ended.value.reason is tether.AbortReason.TIMEOUT, (
                f"a client elsewhere of a stream aborted on its deadline ended "
                f"{ended.value!r} (reason {ended.value.reason.value})"
            )
            await mirror.aclose()
    finally:
        await admin.aclose()


async def _xreads(admin: Redis) -> tuple[int, int]:
    """How many ``XREAD`` Redis ran so far, and how many it refused."""
    stats = (await admin.info("commandstats")).get("cmdstat_xread", {})
    return int(stats.get("calls", 0)), int(stats.get("rejected_calls", 0))


async def test_an_owner_whose_user_is_granted_blocking_goes_back_to_blocked_reads(
    redis_proc: RedisProcess,
) -> None:
    # Promised (docs/resume.md, and DESIGN Invariant 14: "no failure state is permanent
    # while it can recover"): a user without +@blocking has its control streams polled
    # once per block period; once the operator grants +@blocking (the WARNING told
    # them to), the owner's reader blocks on XREAD again (Stop within a round trip).
    async with _denied(redis_proc, "u", "-@blocking") as (admin, registry, _s, owner, _o):
        await _first_read(registry, owner, leave=True)  # (only the owner reads: no mirror)

        async def refused() -> bool:
            return (await _xreads(admin))[1] > 0

        await eventually(refused, timeout=3.0)
        before = (await _xreads(admin))[0]
        await admin.execute_command("ACL", "SETUSER", "u", "+@blocking")

        async def blocks_again() -> bool:
            return (await _xreads(admin))[0] > before

        try:
            await eventually(blocks_again, timeout=3.0)
        except TimeoutError:
            pytest.fail("granted +@blocking, the owner's reader still polls after 3 s")
