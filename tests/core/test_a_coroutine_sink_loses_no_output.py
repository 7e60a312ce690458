"""Outputs reach the consumer exactly once, never dropped (Invariant 4), and misuse is
refused at once with a typed error (Invariant 13): a sink must answer synchronously
whether it took the outputs, so a coroutine function given to ``Stream.set_sink`` is
either refused there, or its outputs still reach the reader; never swallowed as
"taken" by a coroutine object nobody awaits."""

from __future__ import annotations

import warnings
from typing import Any

import tether


async def test_a_coroutine_function_sink_is_refused_or_loses_no_output() -> None:
    registry = tether.Registry()
    stream = registry.open()

    async def sink(outputs: list[Any]) -> bool:
        return True

    try:
        accepted = stream.set_sink(sink)  # type: ignore[arg-type]
    except (TypeError, tether.TetherError):
        await stream.aclose()
        return  # refused at once: as promised
    assert accepted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the unawaited coroutine)
        registry.deliver(stream.rid, "first")
        registry.deliver(stream.rid, "last", finished=True)
    assert [output async for output in stream] == ["first", "last"]
