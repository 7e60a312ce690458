"""``max_pending_bytes`` bounds, with ``merge``, the size of the merged output (the
``Registry`` docstring): a merge that keeps only the newest output (a progress
value, a running total) holds one small output however many were folded into it,
and a consumer that lags behind such a producer is not too slow."""

from __future__ import annotations

import tether


async def test_a_merge_that_keeps_the_newest_output_never_ends_the_request_too_slow() -> None:
    registry = tether.Registry(merge=lambda older, newer: newer, max_pending_bytes=1000)
    stream = registry.open()
    for step in range(50):
        registry.deliver(stream.rid, f"{step:03d}" + "x" * 97)  # 100 characters waiting

    assert stream.rid in registry
    assert await stream.__anext__() == "049" + "x" * 97
    await stream.aclose()


async def test_a_merge_that_sums_keeps_one_number_waiting_within_the_budget() -> None:
    registry = tether.Registry(merge=lambda older, newer: older + newer, max_pending_bytes=256)
    stream = registry.open()
    for _ in range(1000):
        registry.deliver(stream.rid, 1)

    assert stream.rid in registry
    assert await stream.__anext__() == 1000
    await stream.aclose()
