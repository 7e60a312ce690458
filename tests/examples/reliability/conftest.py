"""The reliability suite's fixtures: the example servers run in the test's own loop."""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections.abc import Callable, Mapping

import pytest
import uvloop

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# The example servers are scripts that import their siblings as top-level modules
# (``api``, ``engine``); the suite imports them the same way.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """A test marked ``both_loops`` runs on asyncio's loop and on uvloop (its in-process
    server with it); every other test on asyncio's own loop."""
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
