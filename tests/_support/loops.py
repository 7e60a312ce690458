"""The event loops the suites run on, as ``pytest_asyncio_loop_factories`` answers.

Core behaviour runs on a plain loop and on one whose tasks start eagerly (eager
capture must not depend on scheduling order); an in-process server runs on asyncio's
loop and, for tests marked ``both_loops``, on uvloop too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Final

import pytest
import uvloop

from tests._support.eager import new_eager_loop

LoopFactories = Mapping[str, Callable[[], asyncio.AbstractEventLoop]]

PLAIN: Final[LoopFactories] = {"asyncio": asyncio.new_event_loop}
"""asyncio's own loop alone."""

LAZY_AND_EAGER: Final[LoopFactories] = {"lazy": asyncio.new_event_loop, "eager": new_eager_loop}
"""A plain loop and an eager-task loop: for the core, whose capture is eager."""

SERVER_LOOPS: Final[LoopFactories] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
"""The loops uvicorn runs on."""


def server_loops(item: pytest.Item) -> LoopFactories:
    """:data:`SERVER_LOOPS` for a test marked ``both_loops``, else :data:`PLAIN`."""
    return PLAIN if item.get_closest_marker("both_loops") is None else SERVER_LOOPS
