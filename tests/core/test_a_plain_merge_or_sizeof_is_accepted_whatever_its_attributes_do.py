"""A plain (synchronous) ``merge`` or ``sizeof`` is accepted (Invariant 13: misuse is
refused, never a crash of the caller; refusing a good function is worse than missing
a bad one): the check that looks for a coroutine function must not fail on a callable
whose attribute lookup raises something other than ``AttributeError`` (the familiar
"attribute dict" pattern, ``__getattr__ = dict.__getitem__``)."""

from __future__ import annotations

from typing import Any

import tether


class Settings(dict[str, Any]):
    """A plain callable settings object whose missing attributes raise ``KeyError``."""

    __getattr__ = dict.__getitem__

    def __call__(self, older: Any, newer: Any) -> Any:
        return older + newer


def test_a_plain_merge_with_a_dict_backed_getattr_is_accepted() -> None:
    registry = tether.Registry(merge=Settings(mode="sum"))
    assert registry.merge is not None


def test_a_plain_sizeof_with_a_dict_backed_getattr_is_accepted() -> None:
    class Weigh(Settings):
        def __call__(self, output: Any) -> int:  # type: ignore[override]
            return 1

    tether.Registry(sizeof=Weigh())
