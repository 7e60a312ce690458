"""A rid is held only until its ``on_abort`` has run (Invariant 2, 13): an asynchronous
``on_abort`` is free to name the task it runs in (tracing, debugging tools do), and
once it returned its rid can be opened again; never ``DuplicateRequest`` with
nothing in flight."""

from __future__ import annotations

import asyncio

import tether


def test_a_rid_is_freed_once_an_async_on_abort_that_renamed_its_task_returned() -> None:
    told: list[str] = []
    returned = asyncio.Event()

    async def on_abort(rid: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        task.set_name(f"cancel {rid} in the engine")
        told.append(rid)
        returned.set()

    registry = tether.Registry(on_abort)

    async def first_loop() -> None:
        registry.open("renamed").cancel()
        await returned.wait()  # (asyncio.run lets its task's callbacks run before it ends)

    asyncio.run(first_loop())
    assert told == ["renamed"]
    assert registry.in_flight == 0

    async def next_loop() -> None:
        registry.open("renamed").cancel()  # nothing in flight, on_abort returned: free

    asyncio.run(next_loop())
