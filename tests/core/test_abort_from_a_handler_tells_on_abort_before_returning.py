"""``Registry.abort()`` called by a handler (not inside one of the producer's calls)
calls ``on_abort`` before it returns, whatever the producer did before: the table's
"a producer's call is under way" state is the producer's call's alone, and never
outlives it, even when a ``deliver`` comes from another thread (a misuse refused only
on a request's first output, so a later one runs, and must not leave the registry
deferring every abort from then on)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import tether


async def test_a_handlers_abort_tells_on_abort_before_returning_after_a_deliver_off_the_loop() -> (
    None
):
    told: list[str] = []
    loop_inside = threading.Event()  # the loop's deliver is inside merge
    thread_inside = threading.Event()  # the thread's deliver is inside merge
    loop_returned = threading.Event()  # the loop's deliver has returned
    blocking = {"on": False}

    def merge(older: Any, newer: Any) -> Any:
        if blocking["on"]:
            if newer == "loop":  # (the loop's call)
                loop_inside.set()
                assert thread_inside.wait(10)
            else:
                assert loop_inside.wait(10)
                thread_inside.set()
                assert loop_returned.wait(10)
        return newer

    registry = tether.Registry(told.append, merge=merge)
    a, b, handler_request = registry.open(), registry.open(), registry.open()
    for stream in (a, b):  # first outputs on the loop: checked, then no more checks
        registry.deliver(stream.rid, "first")
    blocking["on"] = True

    def misplaced_producer() -> None:  # delivers from its own thread (misuse)
        assert loop_inside.wait(10)
        try:
            registry.deliver(b.rid, "thread")
        except tether.WrongLoop:  # (refused at once: as good, nothing to race)
            thread_inside.set()

    worker = threading.Thread(target=misplaced_producer)
    worker.start()
    registry.deliver(a.rid, "loop")  # the loop's own producer call, overlapping it
    loop_returned.set()
    await asyncio.to_thread(worker.join, 10)
    assert not worker.is_alive()

    assert registry.abort(handler_request.rid)
    assert told[-1:] == [handler_request.rid], "abort() returned before on_abort was called"
