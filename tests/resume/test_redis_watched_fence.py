"""RedisStore's fence as a transaction (a Redis user without ``+@scripting``: ``WATCH``
the stream's mark and meta, then ``MULTI``/``EXEC``): each scene one promise of
docs/resume.md, against a real ``redis-server`` the test starts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tether
import tether.resume
from tests._support.redis_server import RedisProcess
from tests._support.redis_server import redis_proc as redis_proc

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
