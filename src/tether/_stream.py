"""Stream: the outputs of one request, in the order the producer delivered them.

The reading loop is the :class:`~tether._consumer.Consumer`'s; a stream adds its
request id, its result, and (for a batch's sub-stream) the first read that splits
the batch it belongs to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._consumer import EMPTY, Consumer
from ._state import NOTHING, Group, RequestState

if TYPE_CHECKING:
    from ._table import Table

__all__ = ["Stream"]


class Stream(Consumer):
    """The outputs of one request, in the order the producer delivered them.

    Built by :meth:`Registry.open` and already holding the request's state:
    ``async for output in stream``, ``await stream.result()``, or (adapters)
    ``await stream.next_ready()``. Close it with ``aclose()`` or ``async with``.
    """

    __slots__ = ("_siblings", "_state")

    def __init__(
        self,
        table: Table,
        state: RequestState,
        *,
        siblings: Sequence[RequestState] | None = None,
    ) -> None:
        # A batch's sub-stream (siblings: every sub-request's state) decides its
        # mailbox at the first read, which splits the batch (see Batch.streams).
        super().__init__(table, (state,), None if siblings is not None else state)
        self._state = state
        self._siblings = siblings

    @property
    def rid(self) -> str:
        """The request id to hand to the producer."""
        return self._state.rid

    def __repr__(self) -> str:
        return f"<Stream {self._state.rid!r} live={self._state.live}>"

    def _first_read(self) -> RequestState | Group:
        group, siblings = self._state.group, self._siblings
        if group is not None and siblings is not None and not group.split:
            if group.whole:
                raise RuntimeError(
                    "this batch is already being read as a whole; read the batch, not its .streams"
                )
            group.split_up(siblings)
        self._siblings = None
        self._box = self._state
        return self._state

    async def result(self) -> Any:
        """Wait for the request to finish and return its final output.

        With the registry's ``merge``, every output is folded into the result (for
        producers that emit deltas); without it, the last output is the result.
        The producer folds while the consumer sleeps: no wake-up per output.

        :returns: the result, or ``None`` if the request finished with no output.
        :raises ProducerError: the producer failed the request.
        :raises Aborted: the request was aborted.
        :raises ConcurrentRead: another task is reading this stream (nothing changes
            for that task).
        """
        loop = self._result_loop()
        if self._box is None:
            self._first_read()
        state = self._state
        unread = state.take()
        if self._pos < len(self._buf):  # (an ``async for`` took them, handed out none)
            unread = (self._take_buffered() or EMPTY) + unread
        # _collect_result()'s wait, inline: a JSON answer waits in one coroutine less.
        states = self._states
        self._reading = True
        waited = False
        try:
            if unread or self._collecting:
                self._collect([(0, output) for output in unread], states)
            else:  # (the usual wait: nothing was read before it; _collect()'s first case)
                self._collecting = True
                state.collect(NOTHING)
            while state.live and state.error is None and not self._closed:
                waiter = self._waiter(state, None, loop)
                try:
                    await waiter
                except asyncio.CancelledError:
                    self._cancelled(state, waiter)
                    raise
            waited = True
        finally:
            self._reading = False
            if not waited:
                self._uncollect(states)
        if state.error is not None:
            raise state.error.with_traceback(None)
        return None if state.acc is NOTHING else state.acc
