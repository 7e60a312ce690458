"""Limits: how much may wait for a consumer that falls behind, and what an output weighs.

The mailboxes (``_state``) bound a backlog by a count of outputs and by bytes; the
bytes are estimated by :func:`approximate_size` unless the registry was given its
own ``sizeof``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Iterable
from typing import Any, Final

from .types import Merge, SizeOf

__all__ = [
    "DEFAULT_MAX_PENDING_BYTES",
    "TOO_LARGE",
    "Limits",
    "approximate_size",
    "require_synchronous",
]

DEFAULT_MAX_PENDING_BYTES: Final = 16 * 1024 * 1024
"""The default byte budget of one request's backlog (``Registry(max_pending_bytes=)``)."""

_SIZE_NODES: Final = 1 << 16
"""How many values ``approximate_size`` walks in one output before it measures the
output's JSON encoding instead."""

TOO_LARGE: Final = sys.maxsize
"""The weight of an output too large to walk that is no JSON either: over any budget."""


def approximate_size(output: Any) -> int:
    """About how many bytes ``output`` holds, and never less than a sixth of its JSON
    encoding, whatever its shape: the length of every string and bytes value however
    deep it sits in dicts, lists, tuples, sets and objects (their ``__dict__``,
    ``__slots__``, names and values: dataclasses, pydantic models, an engine's output
    objects), a word per value, and an int's digits.

    (A string's JSON is at most six bytes per character, ``\\u001f``, and
    two quotes; every other value's is within that of its weight.)

    Every value is looked at, so that no shape hides a large string behind many
    small values; past 65,536 values the output is measured by encoding it as JSON
    instead (C speed with orjson), and one that is no JSON (a cycle, an unknown
    object) weighs :data:`TOO_LARGE`. The cost is thus linear in the output and
    bounded: cheap for a token stream's outputs, and it sees the megabyte string
    inside a tool-call delta wherever it sits."""
    cls = type(output)
    if cls is str or cls is bytes:  # (the usual outputs first: no list, no loop)
        return 8 + len(output)
    # Every value is counted once, as it is found (its container's items as the
    # container is walked), so that the bound is checked before a huge one is walked.
    todo = [output]
    total, seen = 0, 1
    pop = todo.pop
    while todo:  # the output, then the containers and other values _leaves() left
        value = pop()
        cls = type(value)
        if cls is dict:
            seen += 2 * len(value)
            if seen > _SIZE_NODES:
                return _encoded_size(output, total)
            total += 8 + _leaves(value, todo) + _leaves(value.values(), todo)
        elif cls is list or cls is tuple:
            seen += len(value)
            if seen > _SIZE_NODES:
                return _encoded_size(output, total)
            total += 8 + _leaves(value, todo)
        elif cls is str or cls is bytes:  # (_leaves() inline: the top output and what
            total += 8 + len(value)  # sets and objects hold, found by _other_size)
        elif cls is int:
            total += 8 + (value.bit_length() >> 2)
        elif cls is float or value is None or cls is bool:
            total += 8
        else:
            found = len(todo)
            total += 8 + _other_size(value, todo)
            seen += len(todo) - found
            if seen > _SIZE_NODES:
                return _encoded_size(output, total)
    return total


def _leaves(values: Iterable[Any], todo: list[Any]) -> int:
    """The weight of the strings, bytes, numbers, ``None`` and booleans among
    ``values``; every other value joins ``todo``."""
    total = 0
    for value in values:
        cls = type(value)
        if cls is str or cls is bytes:
            total += 8 + len(value)
        elif cls is int:
            total += 8 + (value.bit_length() >> 2)  # (>= its decimal digits)
        elif cls is float or value is None or cls is bool:
            total += 8
        else:
            todo.append(value)
    return total


def _encoded_size(output: Any, walked: int) -> int:
    from ._encoders import default_dumps  # (the encoders import nothing of the limits)

    try:
        return max(walked, len(default_dumps(output)))
    except TypeError:
        return TOO_LARGE


# (tuples of types, not ``str | bytes``: a union is built at each call)
_CHARACTERS: Final = (str, bytes, bytearray)
_COLLECTIONS: Final = (list, tuple, set, frozenset)


def _other_size(value: Any, todo: list[Any]) -> int:
    """The weight of a value of another type (a subclass, a set, an object); what it
    holds joins ``todo``."""
    if isinstance(value, _CHARACTERS):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() >> 2
    if isinstance(value, float):
        return 0
    if isinstance(value, dict):
        todo.extend(value.keys())
        todo.extend(value.values())
        return 0
    if isinstance(value, _COLLECTIONS):
        todo.extend(value)
        return 0
    if isinstance(value, memoryview):
        return value.nbytes
    return _object_size(value, todo)


def _object_size(value: Any, todo: list[Any]) -> int:
    """An object's own weight; its attributes' names and values join ``todo`` (it is
    written as a dict of its fields: a long name is as many bytes as a long value)."""
    if isinstance(value, type):
        return 0  # a class (an enum member's __objclass__, say) is shared, not held
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        todo.extend(fields.keys())
        todo.extend(fields.values())
        return 64
    slots = [
        name
        for cls in type(value).__mro__
        for name in getattr(cls, "__slots__", ())
        if isinstance(name, str) and not name.startswith("__")
    ]
    if slots:
        todo.extend(slots)
        todo.extend(getattr(value, name, None) for name in slots)
        return 64
    return sys.getsizeof(value)


def require_synchronous(function: object, what: str) -> None:
    """Refuse a coroutine function where a plain one must answer at once (a sink, a
    ``merge``, a ``sizeof``): its call would return a coroutine nobody awaits, taken
    for an answer. A :func:`functools.partial` is looked through, and an object's
    ``__call__`` is looked up on its class and the classes it inherits from.

    :raises TypeError: ``function`` (or what it wraps, or its ``__call__``) is a
        coroutine function.
    """
    target = function
    for _ in range(8):  # (a __call__ that is itself a callable object, and so on)
        while isinstance(target, functools.partial):
            target = target.func
        if _asynchronous(target):
            raise TypeError(
                f"{what} must be a plain function that answers at once, not a coroutine "
                f"function ({function!r}): its call would return a coroutine nobody awaits"
            )
        if inspect.isroutine(target):
            return  # (a plain function, method or builtin)
        call = inspect.getattr_static(type(target), "__call__", None)
        if isinstance(call, staticmethod | classmethod):
            call = call.__func__
        elif isinstance(call, functools.partialmethod):
            call = call.func
        if call is None:
            return
        target = call


def _asynchronous(function: object) -> bool:
    """Whether calling ``function`` returns a coroutine or an async generator; an
    object that cannot be asked (its ``__getattr__`` raises) is taken as plain."""
    try:
        return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
    except Exception:
        return False


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
