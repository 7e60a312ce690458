"""A sink that raises something that is not an ``Exception`` (KeyboardInterrupt,
SystemExit, a library's own ``BaseException`` such as a test framework's failure or a
greenlet's exit) may let that exception go on to the producer, but it must not leave
the request's sink as the "being offered" marker: the output it was offered stays
readable, the reader can set a sink again, and the producer's last output ends the
request (invariants 2, 4, 11)."""

from __future__ import annotations

from typing import Any

import pytest

import tether


class Stop(BaseException):
    """A BaseException that is not an Exception (as pytest's own failures are)."""


def _raising(exc: BaseException) -> Any:
    def sink(outputs: list[Any]) -> bool:
        raise exc

    return sink


@pytest.mark.parametrize("exc", [Stop("stop"), KeyboardInterrupt(), SystemExit(1)])
async def test_the_output_offered_to_a_sink_that_raises_a_base_exception_is_not_lost(
    exc: BaseException,
) -> None:
    registry = tether.Registry()
    stream = registry.open()
    assert stream.set_sink(_raising(exc))
    with pytest.raises(type(exc)):
        registry.deliver(stream.rid, "a")
    # the producer goes on: its last output ends the request
    registry.deliver(stream.rid, "b", finished=True)
    assert registry.in_flight == 0, "the request never ended: its sink is still the marker"
    assert [output async for output in stream] == ["a", "b"]


async def test_a_stream_whose_sink_raised_a_base_exception_takes_a_sink_again() -> None:
    registry = tether.Registry()
    stream = registry.open()
    assert stream.set_sink(_raising(Stop("stop")))
    with pytest.raises(Stop):
        registry.deliver(stream.rid, "a")
    stream.set_sink(None)
    assert stream.ready() == ["a"]  # (what it was offered waits for the reader)
    taken: list[Any] = []
    assert stream.set_sink(lambda outputs: taken.extend(outputs) or True)
    registry.deliver(stream.rid, "b")
    assert taken == ["b"], "the new sink is never offered anything: the marker stayed"
    await stream.aclose()
