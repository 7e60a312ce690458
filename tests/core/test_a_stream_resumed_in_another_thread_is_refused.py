"""Reading a stream from another thread than its loop's is refused with ``WrongLoop``
before anything is taken (Invariant 13), also when the read is the continuation of
a wait that was checked in the right thread: a coroutine driven by hand (an adapter
for another event system, a test harness) can be resumed anywhere."""

from __future__ import annotations

import threading
from typing import Any

import tether


async def test_a_read_resumed_in_another_thread_after_its_wake_up_is_refused() -> None:
    registry = tether.Registry()
    stream = registry.open()
    read = stream.__anext__()
    read.send(None)  # parks, checked on the loop's thread: yields its waiter
    registry.deliver(stream.rid, 1)  # wakes it
    ended: list[Any] = []

    def resume() -> None:
        try:
            read.send(None)
        except StopIteration as stop:  # it handed the output over
            ended.append(stop.value)
        except BaseException as exc:  # handed to the test, which judges it
            ended.append(exc)

    thread = threading.Thread(target=resume)
    thread.start()
    thread.join()

    assert len(ended) == 1
    assert isinstance(ended[0], tether.WrongLoop)
    assert await stream.__anext__() == 1  # nothing was taken
    await stream.aclose()
