"""The reliability suite's fixtures: the example servers run in the test's own loop
(``tests/examples/conftest.py`` puts ``examples/`` on the path)."""

from __future__ import annotations

import pytest

from tests._support.loops import LoopFactories, server_loops


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """A test marked ``both_loops`` runs on asyncio's loop and on uvloop (its in-process
    server with it); every other test on asyncio's own loop."""
    return server_loops(item)
