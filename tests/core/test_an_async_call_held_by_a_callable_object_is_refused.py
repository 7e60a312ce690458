"""``Registry(merge=...)`` refuses an object whose call returns a coroutine however its
class holds that ``__call__``: an instance of a class with an ``async def __call__``
stored as the class's ``__call__`` (no descriptor: it is called as it is) makes every
call return a coroutine nobody awaits, taken for the merged output."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import tether


class AsyncAdd:
    async def __call__(self, older: Any, newer: Any) -> Any:
        return older + newer


class HeldCall:
    __call__ = AsyncAdd()


def test_an_async_call_held_by_a_callable_object_is_refused() -> None:
    merge = HeldCall()
    result = merge(1, 2)
    assert inspect.iscoroutine(result)  # (the premise: its call is asynchronous)
    result.close()
    with pytest.raises(TypeError):
        tether.Registry(merge=merge)
