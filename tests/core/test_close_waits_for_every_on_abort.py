"""``Registry.close()`` returns once every request is ended and the producer has been
told of every abort (``on_abort``, exactly once, Invariant 3), an asynchronous one
awaited (bounded by ``abort_timeout``): after it the application may stop its engine
and the loop may end. That holds for a request ended inside the producer's last step
(whose ``on_abort`` waits for the step to return) as for any other."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

import tether


class _Yield:
    """One trip through the loop: the asynchronous ``on_abort``'s own work."""

    def __await__(self) -> Generator[None, None, None]:
        yield


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_close_returns_after_on_abort_of_a_request_a_sink_ended_in_the_last_step(
    kind: str,
) -> None:
    told: list[str] = []

    async def on_abort_async(rid: str) -> None:
        await _Yield()
        told.append(rid)

    registry = tether.Registry(on_abort_async if kind == "async" else told.append)
    streaming, other = registry.open(), registry.open()

    def sink(outputs: list[Any]) -> bool:
        other.cancel()  # (say, a proxy's sink that drops a sibling request)
        return True

    assert streaming.set_sink(sink)
    registry.deliver(streaming.rid, "x")  # the producer's last step
    registry.deliver(streaming.rid, "y", finished=True)
    assert registry.in_flight == 0
    await registry.close(drain_timeout=0)
    assert told == [other.rid], "close() returned before the producer was told of the abort"


def test_an_async_on_abort_of_a_request_ended_in_the_last_step_runs_before_asyncio_run_ends() -> (
    None
):
    told: list[str] = []

    async def on_abort(rid: str) -> None:
        await _Yield()
        told.append(rid)

    async def main() -> str:
        registry = tether.Registry(on_abort)
        streaming, other = registry.open(), registry.open()
        assert streaming.set_sink(lambda outputs: (other.cancel(), True)[1])
        registry.deliver(streaming.rid, "x")
        registry.deliver(streaming.rid, "y", finished=True)
        await registry.close(drain_timeout=0)
        return other.rid

    rid = asyncio.run(main())
    assert told == [rid], "on_abort was never awaited: the producer never heard of the abort"
