"""The resumption machinery without HTTP: reading a resume point, the policy's checks,
a follower's exactly-once hand-over on a plain loop and on an eager-task loop, and a
reconnect's wait for its store, which lasts no longer than its request."""

from __future__ import annotations

import asyncio

import pytest

import tether
import tether.resume
from tether.http import Exchange
from tether.resume import Follower, ResumePoint, resume_point

from .conftest import eventually


@pytest.mark.parametrize(
    ("last_event_id", "token", "expected"),
    [
        (None, None, None),
        ("", "", None),
        ("abc.7", None, ("abc", 7)),
        ("7", "abc", ("abc", 7)),
        (None, "abc", ("abc", 0)),
        ("abc.7", "abc", ("abc", 7)),
        ("abc.7", "xyz", ("", -1)),
        ("7", None, ("", -1)),
        ("abc.-1", None, ("", -1)),
        ("abc.٣", None, ("", -1)),
        ("a" * 200 + ".1", None, ("", -1)),
        (" abc.7 ", " abc ", ("abc", 7)),
        (None, "t" * 60_000, ("", -1)),
        ("7", "t" * 200, ("", -1)),
        (None, "tökén", ("", -1)),
        ("tök.3", None, ("", -1)),
        (None, "a\x00b", ("", -1)),
    ],
    ids=[
        "nothing",
        "empty",
        "id-with-token",
        "number-and-token",
        "token-alone",
        "both-agree",
        "both-disagree",
        "number-alone",
        "negative",
        "non-ascii-digit",
        "overlong",
        "spaces-around",
        "huge-token-alone",
        "overlong-token-with-number",
        "non-ascii-token",
        "non-ascii-token-in-id",
        "control-character-token",
    ],
)
def test_a_resume_point_is_read_from_the_id_or_the_token(
    last_event_id: str | None, token: str | None, expected: tuple[str, int] | None
) -> None:
    point = resume_point(last_event_id, token)
    assert (None if point is None else (point.token, point.after)) == expected
    if point is not None:
        assert point.token not in repr(point) or not point.token


@pytest.mark.parametrize("options", [{"grace": 0}, {"grace": -1}, {"max_events": 0}])
def test_a_resume_policy_refuses_bounds_that_keep_nothing(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        tether.resume.Resume(**options)  # type: ignore[arg-type]


async def test_only_a_stream_can_be_resumable_and_a_batch_offered_is_aborted() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    batch = registry.open_batch(2)
    with pytest.raises(TypeError, match="only a tether Stream"):
        await tether.resume.Resume().open(batch)  # type: ignore[arg-type]
    assert sorted(aborted) == sorted(batch.rids)
    assert registry.in_flight == 0


async def test_a_resumable_stream_needs_an_encoder_with_event_ids() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    with pytest.raises(ValueError, match="event ids"):
        Exchange(follower, streaming=True, encoder=tether.NDJSON)
    async with asyncio.timeout(10):
        await resume.aclose()
    assert aborted == [stream.rid]
    assert registry.in_flight == 0


async def test_a_follower_hands_over_every_output_once_in_order_however_they_arrive() -> None:
    registry = tether.Registry()
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    seen: list[object] = []

    async def read() -> None:
        while (items := await follower.next_ready()) is not None:
            seen.extend(output for _, output in items)

    async with asyncio.timeout(10):
        reader = asyncio.create_task(read())
        for n in range(200):
            registry.deliver(stream.rid, n, finished=n == 199)
            if n % 7 == 0:
                await asyncio.sleep(0)  # let the pump and the reader interleave
        await reader
    assert seen == list(range(200))
    assert follower.exhausted
    await follower.aclose()
    await resume.aclose()


@pytest.mark.parametrize("reason", list(tether.AbortReason))
async def test_cancel_aborts_a_follower_as_it_does_a_stream_and_detach_parks_it(
    reason: tether.AbortReason,
) -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume()
    parked, cancelled = registry.open(), registry.open()
    follower = await resume.open(parked)
    assert follower.detach() is False  # its client leaves: the stream waits for a reconnect
    assert aborted == []
    assert registry.in_flight == 2
    other = await resume.open(cancelled)
    assert other.cancel(reason) is True  # one verb, one meaning: the work ends
    assert aborted == [cancelled.rid]
    await resume.aclose()
    assert registry.in_flight == 0


async def test_a_follower_that_cannot_encode_aborts_the_request_not_just_its_client() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    assert isinstance(follower, Follower)
    assert follower.cancel(tether.AbortReason.SERVER)
    assert aborted == [stream.rid]
    async with asyncio.timeout(10):
        with pytest.raises(tether.Aborted):
            await follower.next_ready()
        await resume.aclose()
    with pytest.raises(TypeError, match="only streamed"):
        await follower.result()


async def test_a_follower_cancelled_by_its_scope_parks_the_stream() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume(grace=30)
    with tether.RequestScope() as scope:
        stream = registry.open()
        follower = await resume.open(stream)
        scope.disconnect()
    assert follower.finished
    assert not aborted
    assert resume.store.parked == 1
    registry.deliver(stream.rid, "kept", finished=True)
    again = await resume.follow(resume_point(None, follower.token))  # type: ignore[arg-type]
    assert again is not None
    async with asyncio.timeout(10):
        assert await again.next_ready() == [(f"{follower.token}.1", "kept")]
        assert await again.next_ready() is None
        await resume.aclose()
    assert not aborted


async def test_a_follower_waits_out_each_timeout_even_after_a_longer_one() -> None:
    # (one idle timer per follower, re-armed: a short wait after a long one must not
    # wait out the long one's timer, and an event ends a wait at once)
    registry = tether.Registry()
    resume = tether.resume.Resume()
    stream = registry.open()
    follower = await resume.open(stream)
    async with asyncio.timeout(10):
        assert await follower.next_ready(timeout=0.02) == []  # nothing came: ping time
        waiting = asyncio.create_task(follower.next_ready(timeout=3600))
        registry.deliver(stream.rid, "a")
        assert [output for _, output in await waiting or ()] == ["a"]
        async with asyncio.timeout(5):  # far below the hour the last wait armed
            assert await follower.next_ready(timeout=0.02) == []
        registry.deliver(stream.rid, "b", finished=True)
        assert [output for _, output in await follower.next_ready(timeout=3600) or ()] == ["b"]
        assert await follower.next_ready(timeout=3600) is None
    await follower.aclose()
    await resume.aclose()
    assert registry.in_flight == 0


async def test_a_client_replaced_by_a_newer_one_ends_and_keeps_no_timer() -> None:
    registry = tether.Registry()
    resume = tether.resume.Resume()
    stream = registry.open()
    older = await resume.open(stream)
    async with asyncio.timeout(10):
        waiting = asyncio.create_task(older.next_ready(timeout=3600))  # a ping an hour away
        await asyncio.sleep(0)  # one loop turn: the older client starts its timed wait
        assert older._idle.armed  # noqa: SLF001 (its timer is what is checked)
        newer = await resume.follow(resume_point(None, older.token))  # type: ignore[arg-type]
        assert newer is not None
        with pytest.raises(tether.Aborted, match="resumed elsewhere"):
            await waiting
        assert not older._idle.armed  # noqa: SLF001
        registry.deliver(stream.rid, "x", finished=True)
        assert [output for _, output in await newer.next_ready() or ()] == ["x"]
    await older.aclose()
    await newer.aclose()
    await resume.aclose()
    assert registry.in_flight == 0


async def test_a_parked_stream_whose_waiting_outputs_outweigh_the_byte_budget_is_aborted_once() -> (
    None
):
    # Without resumption the registry's max_pending_bytes bounds a consumer that
    # falls behind; a parked stream's log must be bounded in bytes as well, not only
    # in events.
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume(grace=30, max_bytes=1_000_000)
    with tether.RequestScope() as scope:
        stream = registry.open()
        follower = await resume.open(stream)
        scope.disconnect()
    assert follower.finished
    big = "x" * 100_000
    for _ in range(20):  # 2 MB, far fewer outputs than max_events
        registry.deliver(stream.rid, big)
    await eventually(lambda: registry.in_flight == 0)  # (the pump records them)
    assert aborted == [stream.rid]
    assert len(resume.store) == 0
    await resume.aclose()


async def test_a_stream_keeps_about_its_byte_budget_of_sent_events_for_a_reconnect() -> None:
    aborted: list[str] = []
    registry = tether.Registry(aborted.append)
    resume = tether.resume.Resume(grace=30, max_bytes=1_000_000)
    stream = registry.open()
    follower = await resume.open(stream)
    big = "x" * 100_000
    async with asyncio.timeout(10):
        for n in range(40):  # 4 MB, each read as it comes
            registry.deliver(stream.rid, big, finished=n == 39)
            assert len(await follower.next_ready() or ()) == 1
        await follower.aclose()
        token = follower.token
        assert await resume.follow(resume_point(f"{token}.0", None)) is None  # type: ignore[arg-type]
        again = await resume.follow(resume_point(f"{token}.30", None))  # type: ignore[arg-type]
        assert again is not None
        assert len(await again.next_ready() or ()) == 10
        await again.aclose()
        await resume.aclose()
    assert not aborted
    assert registry.in_flight == 0


class _LookingStore(tether.resume.MemoryStore):
    """An in-process store whose ``follow`` waits (as a shared store's look at its log
    does) until the test lets it answer."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def follow(self, token: str, after: int) -> Follower | None:
        self.asked.set()
        await self.answer.wait()
        return await super().follow(token, after)


async def test_a_wait_whose_request_ended_takes_no_stream_from_its_reader() -> None:
    """Promised (RequestScope.waiting: the wait is "for this request", and what it
    waited for is withdrawn "rather than done for nobody"; the module: "leaving the
    scope closes whatever the handler left open", so no path leaves a request behind;
    current_scope: a task started by the handler that outlives the request belongs to
    no request). A reconnect that a handler started in a task of its own, and that
    still waits for the store when the handler returns, is a wait for a request that is
    over: it ends ``Aborted`` (``cancelled``) and claims nothing, so the client reading
    the stream reads on."""
    registry = tether.Registry()
    store = _LookingStore()
    resume = tether.resume.Resume(grace=30.0, store=store)
    try:
        async with asyncio.timeout(10):
            stream = registry.open()
            reader = await resume.open(stream)  # the client reading the stream
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await reader.next_ready() or ()] == [1]
            scope = tether.RequestScope()
            with scope:  # the reconnect's request; its handler starts a task, returns
                looking = asyncio.create_task(resume.follow(ResumePoint(reader.token, 1)))
                await store.asked.wait()
            store.answer.set()  # the store would answer after the request ended
            outcome: object
            try:
                outcome = await looking
            except BaseException as exc:
                outcome = exc
            registry.deliver(stream.rid, 2)
            try:
                seen: object = [o for _, o in await reader.next_ready(timeout=1.0) or ()]
            except tether.TetherError as exc:
                seen = f"{type(exc).__name__}: {exc}"
    finally:
        await registry.close(drain_timeout=0)
        await resume.aclose()
    assert seen == [2], f"the reader of the stream: {seen!r} (the wait ended with {outcome!r})"
    assert isinstance(outcome, tether.Aborted), outcome
    assert outcome.reason is tether.AbortReason.CANCELLED
