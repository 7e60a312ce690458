"""A client that drops a resumable stream and reconnects gets every event once, in
order, on both adapters and real servers; the request is parked meanwhile, not aborted,
and aborted exactly once when nobody comes back, the cap is passed, Stop is pressed or
the server shuts down."""

from __future__ import annotations

import json
import random
import socket

import aiohttp
import pytest
from redis.asyncio import Redis
from tether_redis import RedisStore

from tether.resume import NOT_RESUMABLE, TOKEN_HEADER

from .conftest import Reader, Site, client, connect, eventually, serving

pytestmark = pytest.mark.timeout(60)


async def reading(site: Site, session: aiohttp.ClientSession) -> tuple[Reader, str]:
    """A client of a new resumable stream that has read its first output, ``"a"``:
    its reader, and the stream's rid."""
    first = await connect(session, f"{site.url}/gen")
    rid = await site.opened()
    site.registry.deliver(rid, "a")
    assert await first.take(1) == ["a"]
    return first, rid


def _outputs(start: int, stop: int) -> list[dict[str, int]]:
    return [{"n": n} for n in range(start, stop)]


async def test_a_client_that_drops_mid_stream_resumes_after_its_last_event_id(
    adapter: str,
) -> None:
    async with serving(adapter) as site, client() as session:
        first = await connect(session, f"{site.url}/gen")
        rid = await site.opened()
        assert first.token is not None
        assert rid not in first.token
        for output in _outputs(0, 3):
            site.registry.deliver(rid, output)
        assert await first.take(3) == _outputs(0, 3)
        assert first.last_id == f"{first.token}.3"
        first.close()
        await site.parked()
        for output in _outputs(3, 6):  # recorded while nobody reads
            site.registry.deliver(rid, output)
        assert rid in site.registry
        assert not site.books.aborts
        second = await connect(
            session, f"{site.url}/gen", headers={"Last-Event-ID": str(first.last_id)}
        )
        assert await second.take(3) == _outputs(3, 6)
        site.registry.deliver(rid, {"n": 6}, finished=True)
        assert await second.rest() == [{"n": 6}, "[DONE]"]
        assert second.last_id == f"{first.token}.7"
        assert not site.books.aborts
        assert site.registry.in_flight == 0


async def test_the_last_event_id_may_come_as_a_query_parameter(adapter: str) -> None:
    async with serving(adapter) as site, client() as session:
        first, rid = await reading(site, session)
        first.close()
        await site.parked()
        site.registry.deliver(rid, "b", finished=True)
        second = await connect(
            session, f"{site.url}/gen", params={"last_event_id": str(first.last_id)}
        )
        assert await second.rest() == ["b", "[DONE]"]
        assert not site.books.aborts


async def test_a_client_that_drops_before_the_first_event_resumes_with_the_token(
    adapter: str,
) -> None:
    async with serving(adapter, grace=5) as site, client() as session:
        first = await connect(session, f"{site.url}/gen")  # the first ping sent the head
        rid = await site.opened()
        token = first.token
        assert token is not None
        first.close()  # before any event
        await site.parked()
        site.registry.deliver(rid, "first")
        site.registry.deliver(rid, "second", finished=True)
        second = await connect(session, f"{site.url}/gen", params={"resume_token": token})
        assert await second.rest() == ["first", "second", "[DONE]"]
        third = await connect(session, f"{site.url}/gen", headers={TOKEN_HEADER: token})
        assert await third.rest() == ["first", "second", "[DONE]"]  # within grace: again
        assert not site.books.aborts


async def test_a_finished_stream_stays_resumable_for_the_grace_period(adapter: str) -> None:
    async with serving(adapter, grace=0.5) as site, client() as session:
        first, rid = await reading(site, session)
        first.close()
        await site.parked()
        site.registry.deliver(rid, "b", finished=True)
        assert site.registry.in_flight == 0  # the request is over; its tail is kept
        second = await connect(
            session, f"{site.url}/gen", headers={"Last-Event-ID": str(first.last_id)}
        )
        assert await second.rest() == ["b", "[DONE]"]
        await site.settled()  # forgotten once the grace period passed
        late = await session.get(f"{site.url}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert late.status == 404
        assert not site.books.aborts


async def test_a_parked_stream_is_aborted_once_when_its_grace_period_passes(
    adapter: str,
) -> None:
    async with serving(adapter, grace=0.3) as site, client() as session:
        first, rid = await reading(site, session)
        first.close()
        await eventually(lambda: site.books.aborts[rid] == 1)
        await site.settled()
        late = await session.get(f"{site.url}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert late.status == 404
        assert not site.registry.deliver(rid, "b")  # the producer was told; late output
        assert site.books.aborts == {rid: 1}


@pytest.mark.parametrize(
    "claim",
    ["wrong-token.1", "123", "", "x" * 500, "{token}.99", "{token}.x"],
    ids=["wrong-token", "no-token", "empty-token", "overlong", "future-event", "bad-number"],
)
async def test_a_reconnect_that_names_no_held_event_is_a_404_that_reveals_nothing(
    adapter: str, claim: str
) -> None:
    async with serving(adapter) as site, client() as session:
        first, rid = await reading(site, session)
        headers = {"Last-Event-ID": claim.format(token=first.token)}
        if claim == "":
            headers = {TOKEN_HEADER: "not-a-token"}
        answer = await session.get(f"{site.url}/gen", headers=headers)
        assert answer.status == 404
        assert json.loads(await answer.read()) == NOT_RESUMABLE.body
        assert TOKEN_HEADER not in answer.headers
        site.registry.deliver(rid, "b", finished=True)
        assert await first.rest() == ["b", "[DONE]"]  # the owner's client is untouched
        assert not site.books.aborts


async def test_a_token_and_an_id_that_disagree_resume_nothing(adapter: str) -> None:
    async with serving(adapter) as site, client() as session:
        first, _ = await reading(site, session)
        answer = await session.get(
            f"{site.url}/gen",
            headers={"Last-Event-ID": f"{first.token}.1", TOKEN_HEADER: "other"},
        )
        assert answer.status == 404
        first.close()


async def test_of_two_reconnects_with_one_token_the_newer_wins_and_the_older_ends(
    adapter: str,
) -> None:
    async with serving(adapter) as site, client() as session:
        first, rid = await reading(site, session)
        last = {"Last-Event-ID": str(first.last_id)}
        older = await connect(session, f"{site.url}/gen", headers=last)
        assert await first.rest() == []  # the first client was replaced: it ends
        site.registry.deliver(rid, "b")
        assert await older.take(1) == ["b"]
        newer = await connect(session, f"{site.url}/gen", headers=last)
        assert await older.rest() == []  # ended without the terminal frame
        site.registry.deliver(rid, "c", finished=True)
        assert await newer.rest() == ["b", "c", "[DONE]"]
        assert not site.books.aborts
        assert site.registry.in_flight == 0


async def test_a_parked_stream_past_its_cap_is_aborted_once(adapter: str) -> None:
    async with serving(adapter, max_events=3) as site, client() as session:
        first, rid = await reading(site, session)
        first.close()
        await site.parked()
        for n in range(3):
            assert site.registry.deliver(rid, n)
        await eventually(lambda: len(site.store) == 1 and site.registry.in_flight == 1)
        assert not site.books.aborts  # three wait: at the cap, not past it
        site.registry.deliver(rid, 3)
        await eventually(lambda: site.books.aborts[rid] == 1)
        await site.settled()
        late = await session.get(f"{site.url}/gen", headers={"Last-Event-ID": str(first.last_id)})
        assert late.status == 404
        assert site.books.aborts == {rid: 1}


async def test_stop_with_the_token_aborts_at_once_and_ends_the_client(adapter: str) -> None:
    async with serving(adapter) as site, client() as session:
        first, rid = await reading(site, session)
        stop = await session.post(f"{site.url}/stop", headers={TOKEN_HEADER: str(first.token)})
        assert stop.status == 204
        assert site.books.aborts == {rid: 1}
        assert await first.rest() == []
        await site.settled()
        again = await session.post(f"{site.url}/stop", headers={TOKEN_HEADER: str(first.token)})
        assert again.status == 404
        assert site.books.aborts == {rid: 1}


async def test_shutdown_ends_parked_streams_and_aborts_each_once(adapter: str) -> None:
    async with client() as session:
        async with serving(adapter) as site:
            readers = [await connect(session, f"{site.url}/gen") for _ in range(3)]
            rids = [await site.opened(count) for count in (1, 2, 3)]
            for reader in readers[:2]:
                reader.close()
            await site.parked(2)
        # serving() closed the registry and the store, then stopped the server
        assert site.books.aborts == dict.fromkeys(rids, 1)
        assert site.registry.in_flight == 0
        assert len(site.store) == 0
        told = await readers[2].next()  # the attached one is told, in a named error event
        assert told is not None
        assert told.event == "error"
        assert told.id is None
        assert told.data["error"]["code"] == 503
        assert await readers[2].rest() == ["[DONE]"]


@pytest.mark.parametrize("seed", range(4))
async def test_drops_at_random_points_lose_and_repeat_no_event(adapter: str, seed: int) -> None:
    plan = random.Random(seed)
    total = 40
    async with serving(adapter) as site, client() as session:
        reader = await connect(session, f"{site.url}/gen")
        rid = await site.opened()
        seen: list[object] = []
        delivered = 0
        while delivered < total:
            burst = plan.randint(1, 8)
            for _ in range(min(burst, total - delivered)):
                site.registry.deliver(rid, delivered, finished=delivered == total - 1)
                delivered += 1
            if plan.random() < 0.5:
                seen += await reader.take(plan.randint(0, delivered - len(seen)))
                last = reader.last_id
                reader.close()
                await site.parked()
                headers = {"Last-Event-ID": last} if last else {TOKEN_HEADER: str(reader.token)}
                token = reader.token
                reader = await connect(session, f"{site.url}/gen", headers=headers)
                assert reader.token == token
                reader.last_id = last
        seen += await reader.rest()
        assert seen == [*range(total), "[DONE]"]
        assert not site.books.aborts
        assert site.registry.in_flight == 0


async def test_a_reconnect_while_the_shared_store_is_down_is_a_503_to_retry(adapter: str) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on: Redis is down
        probe.bind(("127.0.0.1", 0))
        down = f"redis://127.0.0.1:{probe.getsockname()[1]}"
    redis = Redis.from_url(down)
    try:
        async with serving(adapter, store=RedisStore(redis)) as site, client() as session:
            answer = await session.get(
                f"{site.url}/gen", headers={"Last-Event-ID": "A" * 22 + ".1"}
            )
            assert answer.status == 503
            assert answer.headers["Retry-After"] == "1"
            assert (await answer.json())["error"]["code"] == 503
    finally:
        await redis.aclose()
