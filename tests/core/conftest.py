"""Fixtures of the core suite, which runs twice: on a plain event loop and under
``asyncio.eager_task_factory`` (backported to 3.11 in ``tests._support.eager``), since eager
capture must not depend on when a task first runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import tether
from tests._support.loops import LAZY_AND_EAGER, LoopFactories


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """Every async core test runs on a plain loop and on an eager-task loop."""
    return LAZY_AND_EAGER


class AbortLog:
    """An ``on_abort`` callback that records every call and lets a test wait for them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._changed: asyncio.Event | None = None

    def __call__(self, rid: str) -> None:
        self.calls[rid] += 1
        if self._changed is not None:
            self._changed.set()

    @property
    def rids(self) -> set[str]:
        return set(self.calls)

    async def wait_for(self, count: int) -> None:
        """Wait (bounded) until ``count`` calls were recorded, however deferred."""
        async with asyncio.timeout(10):
            while self.calls.total() < count:
                self._changed = asyncio.Event()
                await self._changed.wait()


@pytest.fixture
def aborts() -> AbortLog:
    return AbortLog()


@pytest.fixture
def registry(aborts: AbortLog) -> tether.Registry:
    return tether.Registry(aborts)


async def hand_over_a_bad_step(
    registry: tether.Registry, bad: Callable[[str], Any]
) -> tuple[list[object], list[BaseException], list[dict[str, object]]]:
    """From a producer thread, hand over a step of a good item then ``bad(rid)``,
    keeping the ``TypeError`` it raises there, then a last output alone. Returns what
    the request's reader received, what the thread was refused, and the loop's errors."""
    good = registry.open()
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: loop_errors.append(context))
    refused: list[BaseException] = []

    def engine() -> None:
        try:
            registry.deliver_many_threadsafe([(good.rid, "lost?", False), bad(good.rid)])
        except TypeError as exc:
            refused.append(exc)
        registry.deliver_many_threadsafe([(good.rid, "after", True)])

    worker = threading.Thread(target=engine)
    worker.start()
    async with asyncio.timeout(10):
        received = [output async for output in good]
    await asyncio.to_thread(worker.join)
    return received, refused, loop_errors
