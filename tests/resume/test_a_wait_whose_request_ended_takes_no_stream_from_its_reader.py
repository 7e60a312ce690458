"""Review of RequestScope.waiting() (82adcd1): a wait that outlives its request.

Each test keeps one promise of that merge; the docstrings say which, and what breaks."""

from __future__ import annotations

import asyncio
from typing import Final

import pytest

import tether
import tether.resume
from tether.resume import Follower, ResumePoint

pytestmark = pytest.mark.timeout(60)

BOUND: Final = 10.0


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
    waited for is "withdrawn at once rather than done for a client that left"; the
    module: "leaving the scope closes whatever the handler left open, so no path
    leaves a request behind"; current_scope: a task started by the handler that
    outlives the request belongs to no request). A reconnect that a handler started in
    a task of its own, and that still waits for the store when the handler returns,
    is a wait for a request that is over: nothing can answer it any more.

    What happens: RequestScope.close() does not cut the waits. The wait runs on,
    claims the stream (the client reading it is ended, "resumed elsewhere"), and only
    then _join() finds the scope ended: track() raises RuntimeError and detaches the
    new follower. The stream is left parked, its reader gone, for nobody."""
    registry = tether.Registry()
    store = _LookingStore()
    resume = tether.resume.Resume(grace=30.0, store=store)
    try:
        async with asyncio.timeout(BOUND):
            stream = registry.open()
            reader = await resume.open(stream)  # the client reading the stream
            registry.deliver(stream.rid, 1)
            assert [output for _, output in await reader.next_ready() or ()] == [1]
            scope = tether.RequestScope()
            with scope:  # the reconnect's request; its handler starts a task, returns
                looking = asyncio.create_task(resume.follow(ResumePoint(reader.token, 1)))
                await store.asked.wait()
            store.answer.set()  # the store answers after the request ended
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
