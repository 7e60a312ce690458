"""``Registry(merge=...)`` refuses an object whose call returns a coroutine however its
class holds that ``__call__``: a ``staticmethod`` or a ``functools.partialmethod`` of
an ``async def`` is as asynchronous as the ``async def`` itself (its call would return
a coroutine nobody awaits, taken for the merged output)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import tether


async def add(older: Any, newer: Any) -> Any:
    return older + newer


class StaticCall:
    __call__ = staticmethod(add)


class PartialCall:
    async def _merge(self, older: Any, newer: Any) -> Any:
        return older + newer

    __call__ = functools.partialmethod(_merge)


@pytest.mark.parametrize("merge", [StaticCall(), PartialCall()], ids=["static", "partial"])
def test_an_async_call_held_by_a_descriptor_is_refused(merge: Any) -> None:
    with pytest.raises(TypeError):
        tether.Registry(merge=merge)
