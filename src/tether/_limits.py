"""Limits: how much may wait for a consumer that falls behind, and what an output weighs.

The mailboxes (``_state``) bound a backlog by a count of outputs and by bytes; the
bytes are estimated by :func:`approximate_size` unless the registry was given its
own ``sizeof``.
"""

from __future__ import annotations

import sys
from typing import Any, Final

from .types import Merge, SizeOf

__all__ = ["DEFAULT_MAX_PENDING_BYTES", "Limits", "approximate_size"]

DEFAULT_MAX_PENDING_BYTES: Final = 16 * 1024 * 1024
"""The default byte budget of one request's backlog (``Registry(max_pending_bytes=)``)."""

_SIZE_NODES: Final = 4096
"""How many values ``approximate_size`` looks at in one output before it estimates."""

_SCALARS: Final = (int, float, bool, type(None))


def approximate_size(output: Any) -> int:
    """About how many bytes ``output`` holds: the length of strings and bytes, found
    however deep they sit in dicts, lists, tuples, sets and objects (their
    ``__dict__``, ``__slots__``: dataclasses, pydantic models, an engine's output
    objects), plus a word per value. Past a few thousand values it extrapolates from
    what it saw, so its cost stays bounded whatever the output. Cheap for a token
    stream's outputs, and it sees the megabyte string inside a tool-call delta."""
    total = seen = 0
    todo = [output]
    while todo and seen < _SIZE_NODES:
        value = todo.pop()
        seen += 1
        total += 8  # a word per value, for its reference and header
        if isinstance(value, str | bytes | bytearray):
            total += len(value)
        elif isinstance(value, _SCALARS):
            pass
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list | tuple | set | frozenset):
            todo.extend(value)
        elif isinstance(value, memoryview):
            total += value.nbytes
        else:
            total += _object_size(value, todo)
    if todo:  # too many values to look at all: the rest weigh what the seen ones did
        total += total * len(todo) // seen
    return total


def _object_size(value: Any, todo: list[Any]) -> int:
    """An object's own weight; its attributes' values join ``todo``."""
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        todo.extend(fields.values())
        return 64
    slots = [
        name
        for cls in type(value).__mro__
        for name in getattr(cls, "__slots__", ())
        if isinstance(name, str) and not name.startswith("__")
    ]
    if slots:
        todo.extend(getattr(value, name, None) for name in slots)
        return 64
    return sys.getsizeof(value)


class Limits:
    """How much may wait for a consumer that falls behind (one per registry).

    :param merge: folds a waiting output and a newer one into one, or ``None``.
    :param max_pending: how many outputs may wait without ``merge``.
    :param max_bytes: how many bytes may wait beyond the oldest output (with
        ``merge``: the merged output's size), or ``None``.
    :param sizeof: what one output weighs.
    """

    __slots__ = ("max_bytes", "max_pending", "merge", "sizeof")

    def __init__(
        self, merge: Merge | None, max_pending: int, max_bytes: int | None, sizeof: SizeOf
    ) -> None:
        self.merge = merge
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        self.sizeof = sizeof
