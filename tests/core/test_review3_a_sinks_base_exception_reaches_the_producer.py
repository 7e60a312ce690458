"""Review 3: a sink's BaseException goes on to the producer (CHANGELOG: "lets it go on
to the producer with the request whole"), whatever the fold of the held outputs does."""

from __future__ import annotations

from typing import Any

import pytest

import tether


def _merge_refusing(acc: Any, new: Any) -> Any:
    raise ValueError("merge refuses")


@pytest.mark.parametrize("many", [False, True], ids=["deliver", "deliver_many"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit], ids=["keyboard-interrupt", "system-exit"])
async def test_a_sinks_keyboard_interrupt_reaches_the_producer_even_when_merge_raises_on_the_held_outputs(
    many: bool, exc: type[BaseException]
) -> None:
    """A sink that delivers to its own stream (held behind the offered output) and then
    raises KeyboardInterrupt: put() folds the held output in its ``except BaseException``
    block (``offered(output, sink, False)``); a ``merge`` that raises there replaces the
    KeyboardInterrupt, and deliver()'s ``except Exception`` (merge_failed) swallows it:
    the producer never sees the interrupt (invariant 10: nothing escapes silently)."""
    registry = tether.Registry(merge=_merge_refusing)
    stream = registry.open()
    registry.deliver(stream.rid, "first")
    assert stream.ready() == ["first"]

    def sink(outputs: list[Any]) -> bool:
        registry.deliver(stream.rid, "held")  # held behind the offered one, unfolded
        raise exc()

    assert stream.set_sink(sink)
    step = (
        (lambda: registry.deliver_many([(stream.rid, "x", False)]))
        if many
        else (lambda: registry.deliver(stream.rid, "x"))
    )
    raised: BaseException | None = None
    try:
        step()
    except BaseException as e:  # noqa: BLE001
        raised = e
    assert isinstance(raised, exc), (
        f"the sink's {exc.__name__} never reached the producer: deliver returned normally "
        f"(raised={raised!r}); merge's ValueError replaced it and was handled as a merge failure"
    )
    await stream.aclose()
