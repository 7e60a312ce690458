"""Type aliases used in tether's public signatures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = ["Dumps", "Merge", "OnAbort", "SizeOf"]

Merge: TypeAlias = Callable[[Any, Any], Any]
"""``merge(older, newer) -> combined``: folds two outputs of one request into one."""

OnAbort: TypeAlias = Callable[[str], object]
"""``on_abort(rid)``: a plain function, or a coroutine function (its awaitable is run)."""

Dumps: TypeAlias = Callable[[Any], bytes]
"""Serialises one JSON value to UTF-8 bytes."""

SizeOf: TypeAlias = Callable[[Any], int]
"""``sizeof(output) -> bytes``: what one output weighs against ``max_pending_bytes``."""
