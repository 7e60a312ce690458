"""Outputs reach the consumer exactly once, never dropped (Invariant 4), and misuse is
refused at once with a typed error (Invariant 13): a sink must answer synchronously
whether it took the outputs, so a coroutine function given to ``Stream.set_sink`` is
either refused there, or its outputs still reach the reader; never swallowed as
"taken" by a coroutine object nobody awaits."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest

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


async def test_a_coroutine_function_sink_is_said_to_be_no_sink_and_never_left_unawaited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = tether.Registry()
    stream = registry.open()

    async def sink(outputs: list[Any]) -> bool:
        return True

    stream.set_sink(sink)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (a coroutine never awaited)
        registry.deliver(stream.rid, "only", finished=False)
        gc.collect()
    assert "a coroutine function cannot be one" in caplog.text
    registry.deliver(stream.rid, "last", finished=True)
    assert [output async for output in stream] == ["only", "last"]


@pytest.mark.parametrize("shape", ["function", "callable-object"])
def test_a_coroutine_function_merge_is_refused_at_once(shape: str) -> None:
    async def merge(older: Any, newer: Any) -> Any:
        return newer

    class Merge:
        async def __call__(self, older: Any, newer: Any) -> Any:
            return newer

    with pytest.raises(TypeError, match="coroutine function"):
        tether.Registry(merge=merge if shape == "function" else Merge())  # type: ignore[arg-type]
