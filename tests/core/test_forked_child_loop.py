"""A registry used in a process that forks from inside one of its loop's tasks still
finds the running loop in the child: the parent's loop runs there in no task, however
the child inherited the parent's record of the task it was stepping."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

import tether


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork with threads)
async def test_a_child_forked_inside_a_task_opens_reads_and_delivers_on_its_own_loop() -> None:
    registry = tether.Registry()
    async with registry.open() as stream:  # the registry knows this (the parent's) loop
        registry.deliver(stream.rid, "parent", finished=True)
        assert await stream.result() == "parent"
    pid = os.fork()  # inside this test's task, which the child inherits as running
    if pid == 0:
        code = 3
        try:

            async def child() -> object:
                async with registry.open() as stream:
                    reader = asyncio.create_task(stream.result())
                    await asyncio.sleep(0)  # (a turn: the reader parks on its future)
                    registry.deliver(stream.rid, "child", finished=True)
                    result = await asyncio.wait_for(reader, 30)
                async with registry.open() as stream:

                    async def read() -> list[object]:
                        return [output async for output in stream]

                    reader = asyncio.create_task(read())
                    await asyncio.sleep(0)  # (the same, for an iterating reader)
                    registry.deliver(stream.rid, "streamed", finished=True)
                    return [result, *await asyncio.wait_for(reader, 30)]

            code = 0 if asyncio.run(child()) == ["child", "streamed"] else 2
        except BaseException as exc:  # (the reason goes to the parent's captured stderr)
            print(f"child failed: {exc!r}", file=sys.stderr, flush=True)
            code = 1
        finally:
            os._exit(code)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
