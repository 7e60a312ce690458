"""Batch: the outputs of several sub-requests, read together through one wake-up.

The reading loop is the :class:`~tether._consumer.Consumer`'s, over the batch's
shared mailbox (a :class:`~tether._state.Group`); a batch adds its ids, its
results in order, and per-sub-request :class:`~tether.Stream` s for reading the
sub-requests apart instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._consumer import EMPTY, Consumer
from ._state import NOTHING, Group, RequestState
from ._stream import Stream

if TYPE_CHECKING:
    from ._table import Table

__all__ = ["Batch"]


class Batch(Consumer):
    """The outputs of several sub-requests, read together through one wake-up.

    Built by :meth:`Registry.open_batch`. ``async for index, output in batch``
    yields outputs in arrival order (with ``keep_going``, a failed sub-request
    yields ``(index, error)`` in its place); ``await batch.result()`` returns every
    sub-request's result in order. Alternatively, read each sub-request on its own
    through :attr:`streams`; the first read decides which way the batch is read.

    When one sub-request fails or is aborted (and the batch does not keep going),
    it ends with its own error (a :class:`~tether.ProducerError` from ``fail()``,
    an :class:`~tether.Aborted` from ``abort()``), and each of its live siblings
    ends as :class:`~tether.Aborted` with reason ``failed_sibling``, its message
    naming the failed rid and its ``__cause__`` the failed one's error. Counters,
    observers (``RequestEnd``) and the sub-streams agree: the failed one is counted
    failed (or aborted under its own reason), each sibling ``failed_sibling``.
    The batch read whole (``result()``, ``async for``) raises the failed one's own
    error. A consumer's own abort (``aclose()``, a disconnect, a deadline, a
    consumer too slow) ends a batch read whole with that one error for all.
    """

    __slots__ = ("_group", "_rids", "_streams")

    def __init__(self, table: Table, group: Group) -> None:
        super().__init__(table, group.states, None)
        self._group = group
        self._streams: tuple[Stream, ...] | None = None
        self._rids: tuple[str, ...] | None = None

    def __del__(self) -> None:
        # Once handed out, the sub-streams own their requests and clean up after themselves.
        if getattr(self, "_streams", None) is None:
            super().__del__()

    @property
    def rids(self) -> tuple[str, ...]:
        """The sub-requests' ids, in index order."""
        rids = self._rids
        if rids is None:  # made once: batch.rids[i] in a loop must not cost O(n) each
            rids = self._rids = tuple(state.rid for state in self._states)
        return rids

    def __len__(self) -> int:
        return len(self._states)

    @property
    def keep_going(self) -> bool:
        """Whether a failed sub-request leaves the others running (``open_batch``)."""
        return self._group.keep_going

    def __repr__(self) -> str:
        return f"<Batch of {len(self._states)} remaining={self._group.remaining}>"

    @property
    def streams(self) -> tuple[Stream, ...]:
        """One :class:`Stream` per sub-request, for reading them separately.

        Reading the property changes nothing (log the rids at will). Reading one of
        the sub-streams commits the batch to per-sub-request reading: each gets its
        outputs and its own ending (a failed or aborted sub-request raises its error,
        after what it delivered before, as a :class:`Stream` does), and the batch
        itself can no longer be read; its ``aclose()`` and ``cancel()`` still apply
        to all. The sub-streams cannot be read once the batch itself was.
        """
        if self._streams is None:
            states = self._states
            table = self._table
            self._streams = tuple(Stream(table, state, siblings=states) for state in states)
        return self._streams

    def _first_read(self) -> RequestState | Group:
        group = self._group
        if group.split:
            raise RuntimeError(
                "this batch's sub-streams are being read (.streams); read those instead"
            )
        group.read_whole()
        self._box = group
        return group

    async def result(self) -> list[Any]:
        """Wait for every sub-request and return their results, in index order.

        Each result is folded as :meth:`Stream.result` folds; with ``keep_going``,
        a failed sub-request's error stands in its place.

        :raises ProducerError: a sub-request failed (without ``keep_going``).
        :raises Aborted: the batch was aborted.
        :raises ConcurrentRead: another task is reading this batch (nothing changes
            for that task).
        """
        self._result_loop()
        group = self._group
        if self._box is None:
            self._first_read()
        errors = group.errors or {}
        unread = (self._take_buffered() or EMPTY) + group.take()
        await self._collect_result(
            group, [pair for pair in unread if errors.get(pair[0]) is not pair[1]]
        )
        if group.error is not None:
            raise group.error.with_traceback(None)
        errors = group.errors or {}
        return [
            errors.get(index, None if state.acc is NOTHING else state.acc)
            for index, state in enumerate(self._states)
        ]
