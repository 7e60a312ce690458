"""Per-request state: the entry the registry routes outputs to.

A :class:`RequestState` is both a rid's table entry and, for a single request,
the mailbox its consumer reads from. The sub-requests of a batch share one
:class:`Group` instead: their outputs wait in the group's list as
``(index, output)`` pairs, in arrival order, and one future wakes the batch.

Neither object refers to the ``Stream``/``Batch`` that reads it, so a consumer
dropped without being closed is freed by reference counting and its
``__del__`` can clean up. Both use ``__slots__`` and make no reference cycle
with the consumer: the cyclic garbage collector is a large share of the cost at
ten thousand live requests.

These are internal: only the registry and the consumers touch them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from ._errors import TetherError
    from ._registry import Registry

__all__ = ["DEFAULT_MAX_PENDING_BYTES", "NOTHING", "Group", "RequestState", "approximate_size"]


class _Nothing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Final[Any] = _Nothing()
"""Marks "no output yet" where ``None`` is a valid output."""


DEFAULT_MAX_PENDING_BYTES: Final = 16 * 1024 * 1024
"""The default byte budget of one request's backlog (``Registry(max_pending_bytes=)``)."""

_SIZE_DEPTH: Final = 4


def approximate_size(output: Any, _depth: int = 0) -> int:
    """About how many bytes ``output`` holds: the length of strings and bytes, summed
    through dicts (keys and values), lists and tuples down to a few levels; anything
    else weighs what ``sys.getsizeof`` says. Cheap for the outputs of a token stream,
    and it sees the megabyte string inside an output dict."""
    if isinstance(output, str | bytes | bytearray):
        return len(output)
    if _depth < _SIZE_DEPTH:
        if isinstance(output, dict):
            depth = _depth + 1
            return sum(
                approximate_size(key, depth) + approximate_size(value, depth)
                for key, value in output.items()
            )
        if isinstance(output, list | tuple):
            depth = _depth + 1
            return sum(approximate_size(item, depth) for item in output)
    if isinstance(output, memoryview):
        return output.nbytes
    return sys.getsizeof(output)


def wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Group:
    """The shared mailbox of a batch's sub-requests.

    ``pending`` holds ``(index, output)`` pairs. ``gen`` counts how often the
    consumer took ``pending``: a state whose ``gen`` differs has nothing in the
    current list. The batch is read one way or the other, decided by the first
    read: ``whole`` once the batch itself was read; ``split`` once one of its
    sub-streams was, after which each state keeps its own outputs.
    """

    __slots__ = (
        "collect",
        "error",
        "errors",
        "gen",
        "keep_going",
        "pending",
        "remaining",
        "split",
        "states",
        "timer",
        "waiter",
        "whole",
    )

    def __init__(self, states: list[RequestState], *, keep_going: bool) -> None:
        # Emptied once every sub-request ended (see Registry._release).
        self.states: Sequence[RequestState] = states
        self.keep_going = keep_going
        self.pending: list[tuple[int, Any]] = []
        self.gen = 0
        self.remaining = len(states)
        self.error: TetherError | None = None
        # Per-index errors of a keep-going batch, created on the first one.
        self.errors: dict[int, TetherError] | None = None
        self.collect = False
        self.split = False
        self.whole = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def take(self) -> list[tuple[int, Any]]:
        """Hand every waiting pair to the consumer, oldest first."""
        pending = self.pending
        if pending:
            self.pending = []
            self.gen += 1
        return pending

    def drop(self, indices: set[int]) -> None:
        """Forget the waiting outputs of the sub-requests at ``indices`` (aborted ones)."""
        self.pending = [pair for pair in self.pending if pair[0] not in indices]
        self.gen += 1

    def split_up(self, states: Sequence[RequestState]) -> None:
        """Give each sub-request its own mailbox: from now on each state keeps its
        outputs, and a sub-request's error (``state.error``) ends its own stream.

        :param states: every sub-request's state, in index order.
        """
        errors = self.errors or {}
        for index, output in self.take():
            if errors.get(index) is not output:  # (a keep-going batch's errors stand inline)
                states[index].pending.append(output)
        for state in states:
            state.nbytes = 0
        self.split = True


class RequestState:
    """One rid's entry, and the mailbox of a single request."""

    __slots__ = (
        "acc",
        "collect",
        "error",
        "first_at",
        "gen",
        "group",
        "index",
        "live",
        "nbytes",
        "npending",
        "opened_at",
        "pending",
        "pos",
        "registry",
        "rid",
        "timer",
        "waiter",
    )

    def __init__(
        self, registry: Registry, rid: str, index: int, group: Group | None, opened_at: float
    ) -> None:
        self.registry = registry
        self.rid = rid
        self.index = index
        self.group = group
        self.opened_at = opened_at
        self.first_at = 0.0
        self.live = True
        self.pending: list[Any] = []
        self.error: TetherError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        # In a group: where this state's newest output sits in group.pending
        # (valid while gen == group.gen) and how many of its outputs wait there.
        self.gen = -1
        self.pos = 0
        self.npending = 0
        # Bytes waiting behind the oldest output, counted only while a backlog exists.
        self.nbytes = 0
        # collect mode (result() is waiting): the producer folds into acc and
        # wakes the consumer only when the request ends.
        self.collect = False
        self.acc: Any = NOTHING

    def __repr__(self) -> str:
        return f"<RequestState {self.rid!r} live={self.live}>"
