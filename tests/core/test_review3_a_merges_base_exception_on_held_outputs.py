"""Review 3: a ``merge`` that raises a BaseException (KeyboardInterrupt) while the
outputs held behind a sink's offer are folded (RequestState.offered) goes on to the
producer, but must leave the request whole: the outputs after it are not dropped, and
the request does not end as a success that lacks them."""

from __future__ import annotations

from typing import Any

import tether


def _merge(acc: list[str], new: list[str]) -> list[str]:
    if new == ["boom"]:
        raise KeyboardInterrupt
    return acc + new


async def test_a_merges_keyboard_interrupt_while_folding_held_outputs_drops_no_later_output() -> None:
    registry = tether.Registry(merge=_merge)
    stream = registry.open()
    registry.deliver(stream.rid, ["first"])
    assert stream.ready() == [["first"]]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, ["boom"])  # held behind the offered one
        registry.deliver(stream.rid, ["last"], finished=True)  # held: the producer's last
        return False  # declines: offered() folds ["x"], ["boom"], ["last"]

    assert stream.set_sink(sink)
    interrupted = False
    try:
        registry.deliver(stream.rid, ["x"])
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted  # (it goes on to the producer: documented)
    read: list[Any] = []
    error: BaseException | None = None
    try:
        async for output in stream:
            read.append(output)
    except tether.TetherError as exc:
        error = exc
    flat = [item for output in read for item in output]
    assert error is not None or "last" in flat, (
        f"the request ended as a success without the producer's last output: read {read!r}; "
        "the held outputs after the one merge raised on were dropped (invariant 4)"
    )
