"""Promises both adapters keep, each checked on both, on real servers on 127.0.0.1."""

from __future__ import annotations

import pytest

from tests._support.loops import LoopFactories, server_loops


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> LoopFactories:
    """A test marked ``both_loops`` runs on asyncio's loop and on uvloop (its in-process
    server with it); every other test on asyncio's own loop."""
    return server_loops(item)
