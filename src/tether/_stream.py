"""The consumer side: :class:`Stream` for one request, :class:`Batch` for several.

Both are classes with ``__anext__``, not async generators, so that closing is
deterministic: ``aclose()`` frees whatever is unfinished and calls ``on_abort``
at once, cancellation of the consuming task is an abort, and a consumer dropped
without being closed is cleaned up by ``__del__`` with a ``ResourceWarning``
instead of by a generator finaliser that runs later, elsewhere or never.

Adapters read with :meth:`Stream.next_ready`/:meth:`Batch.next_ready`, which
hand over every output that is ready at once, so that one write can carry them.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

from ._errors import Aborted, AbortReason
from ._scope import current_scope
from ._state import NOTHING, Group, RequestState

if TYPE_CHECKING:
    from ._registry import Registry
    from .types import Merge

__all__ = ["Batch", "Consumer", "Stream"]

_EMPTY: Final[list[Any]] = []
_CLOCK_SLACK: Final = 1e-3
"""An idle timer that fires this close to its deadline counts as on time."""


def _fold(merge: Merge | None, acc: Any, output: Any) -> Any:
    if merge is None or acc is NOTHING:
        return output
    return merge(acc, output)


class Consumer:
    """What :class:`Stream` and :class:`Batch` share: closing, cancelling, waiting."""

    __slots__ = (
        "__weakref__",
        "_buf",
        "_closed",
        "_deadline",
        "_idle_timer",
        "_pos",
        "_registry",
        "_states",
    )

    def __init__(self, registry: Registry, states: Sequence[RequestState]) -> None:
        self._registry = registry
        self._states = states
        self._buf: list[Any] = _EMPTY
        self._pos = 0
        self._closed = False
        # The idle timer of timed waits (next_ready(timeout=...)), see _wait().
        self._deadline: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        """Whether no request of this consumer is in flight any more."""
        return not any(state.live for state in self._states)

    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """Abort whatever is unfinished, now (synchronous; for adapters and scopes).

        ``on_abort`` is called for each unfinished rid; a consumer waiting on this
        stream gets :class:`~tether.Aborted` with ``reason``.

        :returns: whether anything was still in flight.
        """
        states = self._states
        for state in states:
            if state.live:
                error = Aborted(states[0].rid, reason)
                return self._registry._abort_states(states, error, defer=False)
        return False  # the common case at the end of every response: nothing to build

    async def aclose(self) -> None:
        """Close the consumer: unfinished requests are freed and ``on_abort`` is
        called for each, exactly once. Idempotent; later reads end the iteration."""
        self._closed = True
        self._buf = _EMPTY
        self._stop_idle_timer()
        self.cancel(AbortReason.CANCELLED)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        states = getattr(self, "_states", ())
        if any(state.live for state in states):
            warnings.warn(
                f"{self!r} was dropped without being closed; its request was aborted. "
                "Use 'async with', aclose(), or a RequestScope.",
                ResourceWarning,
                source=self,
                stacklevel=1,
            )
            self._registry._abort_from_gc(states)

    def _take_buffered(self) -> list[Any] | None:
        buf, pos = self._buf, self._pos
        if pos >= len(buf):
            return None
        self._buf = _EMPTY
        self._pos = 0
        return buf[pos:] if pos else buf

    async def _until_ended(self, state: RequestState) -> None:
        while state.live:
            await self._wait(state, None)

    async def _wait(self, holder: RequestState | Group, timeout: float | None) -> None:
        """Park until the producer wakes ``holder``'s waiter (or ``timeout`` passes).

        Cancellation of the waiting task is an abort of this consumer.
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        holder.waiter = waiter
        if timeout is None:
            self._deadline = None
        else:
            # One idle timer per consumer, re-armed only when it fires before the
            # current deadline: a stream that gets an output every millisecond must
            # not build, heap-push and cancel a TimerHandle for every output. A timer
            # armed for a later deadline (an earlier, longer timeout) is replaced.
            self._deadline = deadline = loop.time() + timeout
            timer = self._idle_timer
            if timer is None or timer.when() > deadline + _CLOCK_SLACK:
                if timer is not None:
                    timer.cancel()
                self._idle_timer = loop.call_at(deadline, self._on_idle, holder)
        try:
            await waiter
        except asyncio.CancelledError:
            if holder.waiter is waiter:
                holder.waiter = None
            scope = current_scope()
            if scope is not None:
                scope.cancelled()  # the framework may be cancelling because the client left
            self.cancel(AbortReason.CANCELLED)
            raise

    def _on_idle(self, holder: RequestState | Group) -> None:
        self._idle_timer = None
        deadline, waiter = self._deadline, holder.waiter
        if deadline is None or waiter is None or waiter.done():
            return  # no timed wait now: the next one arms the timer again
        loop = waiter.get_loop()
        if loop.time() + _CLOCK_SLACK >= deadline:
            holder.waiter = None
            waiter.set_result(None)
        else:
            self._idle_timer = loop.call_at(deadline, self._on_idle, holder)

    def _stop_idle_timer(self) -> None:
        timer = self._idle_timer
        if timer is not None:
            self._idle_timer = None
            timer.cancel()


class Stream(Consumer):
    """The outputs of one request, in the order the producer delivered them.

    Built by :meth:`Registry.open` and already holding the request's state:
    ``async for output in stream``, ``await stream.result()``, or (adapters)
    ``await stream.next_ready()``. Close it with ``aclose()`` or ``async with``.
    """

    __slots__ = ("_siblings", "_state")

    def __init__(
        self, state: RequestState, *, siblings: Sequence[RequestState] | None = None
    ) -> None:
        super().__init__(state.registry, (state,))
        self._state = state
        # A batch's sub-stream: every sub-request's state, to split the batch's shared
        # mailbox when this stream is first read (see Batch.streams); else None.
        self._siblings = siblings

    def _claim(self, siblings: Sequence[RequestState]) -> None:
        """First read of a batch's sub-stream: commit the batch to per-sub-request reading."""
        group = self._state.group
        if group is not None and not group.split:
            if group.whole:
                raise RuntimeError(
                    "this batch is already being read as a whole; read the batch, not its .streams"
                )
            group.split_up(siblings)
        self._siblings = None

    @property
    def rid(self) -> str:
        """The request id to hand to the producer."""
        return self._state.rid

    def __repr__(self) -> str:
        return f"<Stream {self._state.rid!r} live={self._state.live}>"

    def _exhausted(self) -> bool:
        """Finished cleanly and everything was read (the next read would end)."""
        state = self._state
        return (
            not state.live
            and state.error is None
            and not state.pending
            and self._pos >= len(self._buf)
        )

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        """The next output; ``StopAsyncIteration`` after the last.

        :raises ProducerError: the producer failed the request (after its earlier outputs).
        :raises Aborted: the request was aborted (timeout, disconnect, server, too slow).
        """
        buf, pos = self._buf, self._pos
        if pos < len(buf):
            self._pos = pos + 1
            return buf[pos]
        if self._siblings is not None:
            self._claim(self._siblings)
        state = self._state
        while True:
            if self._closed:
                raise StopAsyncIteration
            pending = state.pending
            if pending:
                state.pending = []
                state.nbytes = 0
                self._buf = pending
                self._pos = 1
                return pending[0]
            if state.error is not None:
                raise state.error.with_traceback(None)
            if not state.live:
                raise StopAsyncIteration
            await self._wait(state, None)

    async def next_ready(self, *, timeout: float | None = None) -> list[Any] | None:
        """Every output that is ready, oldest first, waiting for one if none is.

        :param timeout: give up waiting after this many seconds and return ``[]``.
        :returns: a non-empty list, ``[]`` when ``timeout`` passed with nothing
            ready, or ``None`` once the request finished and everything was read.
        :raises ProducerError: as for ``__anext__``.
        :raises Aborted: as for ``__anext__``.
        """
        if self._siblings is not None:
            self._claim(self._siblings)
        rest = self._take_buffered()
        state = self._state
        waited = False
        while True:
            if self._closed:
                return None
            pending = state.pending
            if pending:
                state.pending = []
                state.nbytes = 0
                if rest:
                    rest.extend(pending)
                    return rest
                return pending
            if rest:
                return rest
            if state.error is not None or not state.live:
                self._stop_idle_timer()
                if state.error is not None:
                    raise state.error.with_traceback(None)
                return None
            if waited:
                return []
            await self._wait(state, timeout)
            waited = timeout is not None

    async def result(self) -> Any:
        """Wait for the request to finish and return its final output.

        With the registry's ``merge``, every output is folded into the result (for
        producers that emit deltas); without it, the last output is the result.
        The producer folds while the consumer sleeps: no wake-up per output.

        :returns: the result, or ``None`` if the request finished with no output.
        :raises ProducerError: the producer failed the request.
        :raises Aborted: the request was aborted.
        """
        if self._siblings is not None:
            self._claim(self._siblings)
        state = self._state
        merge = self._registry.merge
        acc = NOTHING
        for output in (self._take_buffered() or _EMPTY) + state.pending:
            acc = _fold(merge, acc, output)
        state.pending = []
        state.nbytes = 0
        if state.live and not self._closed:
            state.acc = acc
            state.collect = True
            await self._until_ended(state)
            acc = state.acc
        if state.error is not None:
            raise state.error.with_traceback(None)
        return None if acc is NOTHING else acc


class Batch(Consumer):
    """The outputs of several sub-requests, read together through one wake-up.

    Built by :meth:`Registry.open_batch`. ``async for index, output in batch``
    yields outputs in arrival order; ``await batch.result()`` returns every
    sub-request's result in order. Alternatively, read each sub-request on its own
    through :attr:`streams`; the first read decides which way the batch is read.
    """

    __slots__ = ("_group", "_streams")

    def __init__(self, registry: Registry, group: Group) -> None:
        super().__init__(registry, group.states)
        self._group = group
        self._streams: tuple[Stream, ...] | None = None

    def __del__(self) -> None:
        # Once split, each sub-stream owns its request and cleans up after itself.
        if getattr(self, "_streams", None) is None:
            super().__del__()

    @property
    def rids(self) -> tuple[str, ...]:
        """The sub-requests' ids, in index order."""
        return tuple(state.rid for state in self._states)

    def __len__(self) -> int:
        return len(self._states)

    @property
    def keep_going(self) -> bool:
        """Whether a failed sub-request leaves the others running (``open_batch``)."""
        return self._group.keep_going

    def _exhausted(self) -> bool:
        """Every sub-request finished, no error, everything read."""
        group = self._group
        return (
            group.remaining == 0
            and group.error is None
            and not group.pending
            and self._pos >= len(self._buf)
        )

    def __repr__(self) -> str:
        group = self._group
        return f"<Batch of {len(self._states)} remaining={group.remaining}>"

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
            self._streams = tuple(Stream(state, siblings=states) for state in states)
        return self._streams

    def _start(self) -> Group:
        group = self._group
        if group.split:
            raise RuntimeError(
                "this batch's sub-streams are being read (.streams); read those instead"
            )
        group.whole = True
        return group

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        """The next ``(index, output)`` pair in arrival order.

        With ``keep_going``, a failed sub-request yields ``(index, error)``.

        :raises ProducerError: a sub-request failed (without ``keep_going``).
        :raises Aborted: the batch was aborted.
        """
        buf, pos = self._buf, self._pos
        if pos < len(buf):
            self._pos = pos + 1
            pair: tuple[int, Any] = buf[pos]
            return pair
        group = self._start()
        while True:
            if self._closed:
                raise StopAsyncIteration
            pending = group.take()
            if pending:
                self._buf = pending
                self._pos = 1
                return pending[0]
            if group.error is not None:
                raise group.error.with_traceback(None)
            if group.remaining == 0:
                raise StopAsyncIteration
            await self._wait(group, None)

    async def next_ready(self, *, timeout: float | None = None) -> list[tuple[int, Any]] | None:
        """Every ``(index, output)`` pair that is ready, waiting for one if none is.

        Same contract as :meth:`Stream.next_ready`.
        """
        rest = self._take_buffered()
        group = self._start()
        waited = False
        while True:
            if self._closed:
                return None
            pending = group.take()
            if pending:
                if rest:
                    rest.extend(pending)
                    return rest
                return pending
            if rest:
                return rest
            if group.error is not None or group.remaining == 0:
                self._stop_idle_timer()
                if group.error is not None:
                    raise group.error.with_traceback(None)
                return None
            if waited:
                return []
            await self._wait(group, timeout)
            waited = timeout is not None

    async def result(self) -> list[Any]:
        """Wait for every sub-request and return their results, in index order.

        Each result is folded as :meth:`Stream.result` folds; with ``keep_going``,
        a failed sub-request's error stands in its place.

        :raises ProducerError: a sub-request failed (without ``keep_going``).
        :raises Aborted: the batch was aborted.
        """
        group = self._start()
        merge = self._registry.merge
        states = self._states
        accs: list[Any] = [NOTHING] * len(states)
        errors = group.errors or {}
        for index, output in (self._take_buffered() or _EMPTY) + group.take():
            if errors.get(index) is not output:
                accs[index] = _fold(merge, accs[index], output)
        for state, acc in zip(states, accs, strict=True):
            state.acc = acc
            state.collect = True
        while group.remaining and group.error is None and not self._closed:
            await self._wait(group, None)
        if group.error is not None:
            raise group.error.with_traceback(None)
        errors = group.errors or {}
        return [
            errors.get(index, None if state.acc is NOTHING else state.acc)
            for index, state in enumerate(states)
        ]
