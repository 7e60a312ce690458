"""A sink answers whether it took the outputs: ``True``, or a truthy answer that is no
``bool`` (a count of bytes written, say), takes them and stays the sink, as
``_answer_of`` promises ("a truthy one took the outputs, as before"); only a falsy
answer (or an awaitable) declines and hands the outputs to the reader."""

from __future__ import annotations

from typing import Any

import pytest

import tether


@pytest.mark.parametrize("answer", [True, 1, "written", [1]])
async def test_a_sink_that_answers_truthy_is_offered_the_next_output_too(answer: Any) -> None:
    registry = tether.Registry()
    stream = registry.open()
    offered: list[list[Any]] = []

    def sink(outputs: list[Any]) -> Any:
        offered.append(list(outputs))
        return answer

    stream.set_sink(sink)
    registry.deliver(stream.rid, 1)
    registry.deliver(stream.rid, 2)

    assert offered == [[1], [2]]
    assert not stream.ready()
    await stream.aclose()
