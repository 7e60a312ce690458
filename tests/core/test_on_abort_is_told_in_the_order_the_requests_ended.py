"""``on_abort`` is told of the requests in the order they ended (``Registry``'s
docstring: deferred past the producer's step "in the order the requests ended"), and a
handler's ``abort()`` tells it before returning: both hold together, so a request
ended inside the producer's step is told before one a handler aborts after it."""

from __future__ import annotations

from typing import Any

import tether


async def test_a_request_ended_in_the_step_is_told_before_one_a_handler_aborts_after_it() -> None:
    told: list[str] = []
    registry = tether.Registry(told.append)
    streaming, ended_in_step, aborted_after = registry.open(), registry.open(), registry.open()

    def sink(outputs: list[Any]) -> bool:
        ended_in_step.cancel()
        return True

    assert streaming.set_sink(sink)
    registry.deliver(streaming.rid, "x")  # the producer's step ends ended_in_step
    assert registry.abort(aborted_after.rid)  # then a handler aborts another
    assert told[-1:] == [aborted_after.rid], "abort() returned before on_abort was called"
    assert told == [ended_in_step.rid, aborted_after.rid], "told out of the order they ended"
    await streaming.aclose()
