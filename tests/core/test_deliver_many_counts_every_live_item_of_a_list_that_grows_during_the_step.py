"""``Registry.deliver_many(items)`` returns how many of the items it delivered were live.

A list is a list while the step runs: the items the step iterates over are the items it
counts. A sink (or ``merge``, an observer) that runs inside the step and appends a
follow-up triple to the step's own list (a relay that forwards what it is handed, as
its producer does for the rest of the step) has that item delivered: it must be counted
as live if it was, and nothing appended must make the count drop below what was
delivered (a late item appended must not cost a live one its count).
"""

from __future__ import annotations

from typing import Any

import tether


def _step_that_grows(
    registry: tether.Registry, extra: tuple[str, Any, bool]
) -> tuple[int, list[tuple[str, Any, bool]]]:
    """deliver_many() of a one-item step whose sink appends ``extra`` (rid ``"b"``: a
    second live request's); its answer and the step as it ended."""
    a, b = registry.open(), registry.open()
    registry.deliver(a.rid, "first")  # (past the first output: the usual case)
    registry.deliver(b.rid, "first")
    step: list[tuple[str, Any, bool]] = [(a.rid, 1, False)]

    def relay(outputs: list[Any]) -> bool:
        step.append(extra if extra[0] != "b" else (b.rid, extra[1], extra[2]))
        return True

    a.ready()  # nothing left ready: the sink may be set
    assert a.set_sink(relay)
    return registry.deliver_many(step), step


async def test_a_live_item_appended_during_the_step_is_counted() -> None:
    registry = tether.Registry()
    count, step = _step_that_grows(registry, ("b", 2, False))
    assert len(step) == 2  # both delivered, both live
    assert count == 2


async def test_a_late_item_appended_during_the_step_costs_no_live_one_its_count() -> None:
    registry = tether.Registry()
    count, step = _step_that_grows(registry, ("no-such-rid", 2, False))
    assert len(step) == 2  # one live, one late
    assert count == 1
