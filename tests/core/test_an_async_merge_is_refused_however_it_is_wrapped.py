"""``Registry(merge=...)`` refuses a coroutine function (its call returns a coroutine
nobody awaits, taken for the merged output): an object whose ``__call__`` is
``async`` is one, whether it defines ``__call__`` or inherits it, and so is a
``functools.partial`` of one."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import tether


class AsyncMerge:
    async def __call__(self, older: Any, newer: Any) -> Any:
        return older + newer


class Concatenate(AsyncMerge):
    """Inherits its ``async __call__``."""


def test_a_merge_that_inherits_an_async_call_is_refused() -> None:
    with pytest.raises(TypeError):
        tether.Registry(merge=Concatenate())


def test_a_partial_of_an_object_with_an_async_call_is_refused() -> None:
    with pytest.raises(TypeError):
        tether.Registry(merge=functools.partial(AsyncMerge()))


def test_an_async_merge_and_its_partial_are_refused() -> None:
    async def merge(older: Any, newer: Any) -> Any:
        return older + newer

    with pytest.raises(TypeError):
        tether.Registry(merge=functools.partial(merge))
    with pytest.raises(TypeError):
        tether.Registry(merge=AsyncMerge())
