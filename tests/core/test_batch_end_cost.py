"""Ending a batch costs O(its size), and ending one of its sub-requests O(1): counted
as the lines of tether's own code that run (every iteration of a loop or a
comprehension is a line run), for two sizes in one run: linear work grows as the
size does, quadratic work as its square. Counting is exact whatever the machine's
load, unlike a time."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import tether

_SMALL, _LARGE = 500, 4_000
"""Eight times the size: linear work grows about 8 times, quadratic about 64."""

_CORE = str(Path(tether.__file__).parent)


def _lines_run(call: Callable[[], object]) -> int:
    """How many lines of the core ``call()`` runs."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(_CORE) else None

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def _growth(end: Callable[[int], Callable[[], object]]) -> float:
    """The work of ending at ``_LARGE`` over the work at ``_SMALL``."""
    return _lines_run(end(_LARGE)) / _lines_run(end(_SMALL))


def _batch_with_outputs_waiting(size: int, **options: bool) -> tuple[tether.Registry, tether.Batch]:
    registry = tether.Registry(max_pending=4)
    batch = registry.open_batch(size, **options)
    for rid in batch.rids:
        registry.deliver(rid, {"text": "x"})
        registry.deliver(rid, {"text": "y"})
    return registry, batch


async def test_cancelling_a_batch_read_whole_costs_linear_work_in_its_size() -> None:
    def end(size: int) -> Callable[[], object]:
        registry, batch = _batch_with_outputs_waiting(size)
        batch.ready()  # read whole from now on (what waited is taken; more comes)
        for rid in batch.rids:
            registry.deliver(rid, {"text": "z"})
        return batch.cancel

    assert _growth(end) < 10


async def test_failing_one_sub_request_of_a_batch_costs_linear_work_in_its_size() -> None:
    def end(size: int) -> Callable[[], object]:
        registry, batch = _batch_with_outputs_waiting(size)
        rid = batch.rids[size // 2]
        return lambda: registry.fail(rid, RuntimeError("bad"))

    assert _growth(end) < 10


async def test_aborting_one_sub_request_of_a_keep_going_batch_costs_the_same_at_any_size() -> None:
    def end(size: int) -> Callable[[], object]:
        registry, batch = _batch_with_outputs_waiting(size, keep_going=True)
        rid = batch.rids[size // 2]
        return lambda: registry.abort(rid)

    assert _growth(end) < 1.5
