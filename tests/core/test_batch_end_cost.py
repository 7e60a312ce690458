"""Ending a batch costs O(its size), and ending one of its sub-requests O(1): the
ratio between two sizes measured in one run (never an absolute time)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import tether

_SMALL, _LARGE = 1_000, 8_000
"""Eight times the size: linear costs about 8 times as much, quadratic about 64
(the bound, 32, leaves room for a loaded machine)."""


def _ratio(run: Callable[[int], float]) -> float:
    """The cost at ``_LARGE`` over the cost at ``_SMALL``: the best of several runs of
    each, interleaved, with the cyclic collector paused (its passes are not ours)."""
    run(_SMALL)  # warm up
    small: list[float] = []
    large: list[float] = []
    gc.disable()
    try:
        for _ in range(5):
            small.append(run(_SMALL))
            large.append(run(_LARGE))
    finally:
        gc.enable()
    return min(large) / min(small)


def _batch_with_outputs_waiting(size: int, **options: bool) -> tuple[tether.Registry, tether.Batch]:
    registry = tether.Registry(max_pending=4)
    batch = registry.open_batch(size, **options)
    for rid in batch.rids:
        registry.deliver(rid, {"text": "x"})
        registry.deliver(rid, {"text": "y"})
    return registry, batch


async def test_cancelling_a_batch_read_whole_costs_linear_time_in_its_size() -> None:
    def run(size: int) -> float:
        registry, batch = _batch_with_outputs_waiting(size)
        batch.ready()  # read whole from now on (what waited is taken; more comes)
        for rid in batch.rids:
            registry.deliver(rid, {"text": "z"})
        start = time.perf_counter()
        batch.cancel()
        elapsed = time.perf_counter() - start
        assert registry.in_flight == 0
        return elapsed

    assert _ratio(run) < 32


async def test_failing_one_sub_request_of_a_batch_costs_linear_time_in_its_size() -> None:
    def run(size: int) -> float:
        registry, batch = _batch_with_outputs_waiting(size)
        start = time.perf_counter()
        registry.fail(batch.rids[size // 2], RuntimeError("bad"))
        elapsed = time.perf_counter() - start
        assert registry.in_flight == 0
        return elapsed

    assert _ratio(run) < 32


async def test_aborting_every_sub_request_of_a_keep_going_batch_costs_linear_time() -> None:
    """One abort at a time: each costs O(1), not a pass over what waits."""

    def run(size: int) -> float:
        registry, batch = _batch_with_outputs_waiting(size, keep_going=True)
        start = time.perf_counter()
        for rid in batch.rids:
            registry.abort(rid)
        elapsed = time.perf_counter() - start
        assert registry.in_flight == 0
        return elapsed

    assert _ratio(run) < 32
