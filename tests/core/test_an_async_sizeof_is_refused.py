"""``sizeof`` answers at once, like ``merge``: a coroutine function's call returns a
coroutine nobody awaits. ``Registry()`` refuses it with ``TypeError``, as it does an
async ``merge``, rather than accepting it and failing the first request that backs up
(with a "coroutine was never awaited" warning per output weighed)."""

from __future__ import annotations

import pytest

import tether


def test_registry_refuses_a_coroutine_function_as_sizeof() -> None:
    async def sizeof(output: object) -> int:
        return 1

    with pytest.raises(TypeError):
        tether.Registry(sizeof=sizeof)
