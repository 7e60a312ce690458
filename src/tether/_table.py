"""The table ``rid -> state`` and the one path by which a request ends.

:class:`Table` is what :class:`~tether.Registry` stands in front of: it admits
requests, hands out fresh ids, and ends them. Every end goes through
:meth:`Table.finish` (the producer's last output) or :meth:`Table.end` (an error:
the producer's failure, a server abort, a consumer closing early), which free the
entry, count the end once, tell the observers, record it in the mailbox and wake
the consumer; and decide, in one place, whether the producer is told through ``on_abort``. The
batch rule lives here too: a sub-request that fails on its own ends its batch,
unless the batch keeps going.

``on_abort`` is called at once, except when the table is entered from the
producer's own call (``deliver``/``fail``) or from a garbage collector's
finaliser: then it runs soon after on the loop (``defer``), so that it never
re-enters the producer in the middle of its step.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Final

from ._errors import (
    Aborted,
    AbortReason,
    ConsumerTooSlow,
    InvalidRequest,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    TetherError,
    WrongLoop,
)
from ._limits import Limits
from ._notify import Notifier
from ._observe import Observer, observe_end
from ._state import RequestState
from ._stats import RegistryStats, Summary, sample_buffer
from .types import OnAbort

__all__ = ["Table"]

logger = logging.getLogger("tether")

now: Final = time.monotonic


FAILED_SIBLING: Final = AbortReason.FAILED_SIBLING


def failed_sibling(rid: str, failed: str, error: TetherError) -> Aborted:
    """How a sub-request ends when ``failed``, another of its batch, ended first with
    ``error`` (its ``__cause__``): aborted, reason ``failed_sibling``."""
    aborted = Aborted(
        rid,
        FAILED_SIBLING,
        f"request {rid!r} was aborted: request {failed!r} of its batch ended first "
        f"({type(error).__name__})",
    )
    aborted.__cause__ = error
    return aborted


class Table:
    """The in-flight requests of one registry, their counters and ``on_abort``.

    :param on_abort: see :class:`~tether.Registry`.
    :param max_in_flight: the admission limit, or ``None``.
    :param limits: what may wait for a slow consumer.
    :param abort_timeout: bound on an asynchronous ``on_abort``.
    """

    __slots__ = (
        "_aborted",
        "_failed",
        "_finished",
        "_idle",
        "_ids",
        "_loop",
        "_notifier",
        "_opened",
        "_prefix",
        "_thread",
        "_total",
        "closed",
        "entries",
        "late",
        "limits",
        "max_in_flight",
        "observers",
        "ttfo",
    )

    def __init__(
        self,
        on_abort: OnAbort | None,
        *,
        max_in_flight: int | None,
        limits: Limits,
        abort_timeout: float,
    ) -> None:
        self.entries: dict[str, RequestState] = {}
        self.max_in_flight = max_in_flight
        self.limits = limits
        self.closed = False
        self._notifier = Notifier(on_abort, abort_timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._idle: asyncio.Event | None = None
        self._prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)
        self._opened = self._finished = self._failed = 0
        self.late = 0
        """Producer calls for a rid no longer in flight (the registry counts them)."""
        self._aborted: collections.Counter[str] = collections.Counter()
        self.ttfo = sample_buffer()
        """Times from open to first output (the registry samples them in deliver)."""
        self._total = sample_buffer()
        self.observers: tuple[Observer, ...] = ()  # attached by Registry.add_observer

    # -- admission ------------------------------------------------------------------

    def admit(self, count: int, timeout: float | None) -> asyncio.AbstractEventLoop:
        """Check that ``count`` more requests may open now; the loop they run on.

        :raises ValueError: a non-positive ``timeout``.
        :raises RegistryClosed: the registry is closing.
        :raises Overloaded: they do not fit under ``max_in_flight`` now.
        """
        if timeout is not None and not timeout > 0:
            raise InvalidRequest(
                f"timeout must be a positive number of seconds or None, got {timeout}"
            )
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise WrongLoop(
                "Registry.open() runs on the server's event loop, and no loop runs in "
                f"thread {threading.current_thread().name!r} (a sync FastAPI dependency "
                "runs in a thread pool: make it 'async def'); from another thread, open "
                "on the loop (asyncio.run_coroutine_threadsafe) and deliver with "
                "deliver_threadsafe()"
            ) from None
        if loop is not self._loop:
            if self.entries:
                raise WrongLoop(
                    "this registry's requests run on another event loop: open them on "
                    "that loop, or give each event loop its own Registry"
                )
            self._loop = loop
            self._thread = threading.get_ident()
        if self.closed:
            raise RegistryClosed()
        limit = self.max_in_flight
        if limit is not None and len(self.entries) + count > limit:
            raise Overloaded(limit)
        return loop

    def fresh_rid(self) -> str:
        """An id no live request has."""
        # A client may have chosen the next fresh id already (the prefix is visible
        # in every rid handed out): skip it rather than take its entry.
        entries, notifier = self.entries, self._notifier
        while True:
            rid = f"{self._prefix}-{next(self._ids)}"
            if rid not in entries and not notifier.holds(rid):
                return rid

    def insert(self, states: Sequence[RequestState]) -> None:
        """Register ``states``, whose rids the caller checked are not live."""
        entries = self.entries
        for state in states:
            entries[state.rid] = state  # checked absent: no path overwrites a live entry
        self._opened += len(states)

    def require_loop(self) -> asyncio.AbstractEventLoop:
        """The loop requests were opened on, for hand-overs from other threads.

        :raises WrongLoop: no request was opened yet, or that loop is closed.
        """
        loop = self._loop
        if loop is None:
            raise WrongLoop("no request was opened on this registry yet: no loop to hand over to")
        if loop.is_closed():
            raise WrongLoop("the event loop this registry's requests ran on is closed")
        return loop

    def own_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, checked to be the one requests are opened on (a consumer
        parks on a future that the producer resolves on that loop).

        :raises WrongLoop: running on another loop.
        """
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise WrongLoop(
                "a Stream or Batch is read on another event loop than the one its "
                "request was opened on: read it where it was opened"
            )
        return loop

    def check_thread(self, what: str) -> None:
        """Refuse a call that changes the table from another thread than the loop's.

        :raises WrongLoop: called from another thread.
        """
        thread = self._thread
        if thread is not None and thread != threading.get_ident():
            raise WrongLoop(
                f"{what} was called from thread {threading.current_thread().name!r}, not "
                "the thread of the registry's event loop: use the *_threadsafe methods "
                "(or loop.call_soon_threadsafe)"
            )

    # -- the end of a request ---------------------------------------------------------

    def finish(self, state: RequestState) -> None:
        """The producer delivered ``state``'s last output."""
        if not state.live:
            return  # ended meanwhile (something inside deliver() re-entered the table)
        self._finished += 1
        self._release(state, None, None)
        state.end(None)

    def end(self, state: RequestState, error: TetherError, *, tell: bool, defer: bool) -> None:
        """End one live request with ``error``, decided for it alone (the producer
        failed it, the server aborted it, its last output overflowed a slow consumer).

        :param tell: call ``on_abort`` for it (not when the producer already knows).
        :param defer: run ``on_abort`` soon, not now (entered from the producer).

        In a batch that does not keep going, the other sub-requests are aborted with
        the same error (reason ``failed_sibling``), and the producer is told of each.
        """
        reason = error.reason if isinstance(error, Aborted) else None
        ended = self._close((state,), error, reason)
        siblings: list[str] = []
        group = state.group
        if ended and group is not None and not group.keep_going:
            for sibling in [sibling for sibling in group.states if sibling.live]:
                siblings += self._close(
                    (sibling,), failed_sibling(sibling.rid, state.rid, error), FAILED_SIBLING
                )
        # Told only once the table is consistent again: on_abort may re-enter it.
        self._tell(ended if tell else [], defer)
        self._tell(siblings, defer)

    def end_rid(self, rid: str, error: TetherError, *, tell: bool, defer: bool) -> bool:
        """:meth:`end` the request ``rid`` if it is live; else count a late call.

        :returns: whether it was live.
        """
        state = self.entries.get(rid)
        if state is None:
            self.late += 1
            return False
        self.end(state, error, tell=tell, defer=defer)
        return True

    def abort(self, states: Sequence[RequestState], error: Aborted, *, defer: bool) -> bool:
        """Abort what is live of one consumer's ``states``, telling the producer of each.

        A batch read whole is aborted whole; a split batch's sub-stream only itself.

        :returns: whether anything was live.
        """
        told = self._abort_live(states, error)
        self._tell(told, defer)
        return bool(told)

    def _abort_live(self, states: Sequence[RequestState], error: Aborted) -> list[str]:
        """End the live ones of one consumer's ``states`` (a batch read whole: all of
        it, and reading it raises ``error``); the rids ended, for :meth:`_tell`."""
        live = [state for state in states if state.live]
        if not live:
            return []
        group = live[0].group
        if group is not None and not group.split:
            live = [state for state in group.states if state.live]
            group.error = error
        return self._close(live, error, error.reason)

    def too_slow(self, state: RequestState, finished: bool) -> None:
        """``state``'s backlog went over a limit (called from inside ``deliver``)."""
        limits = self.limits
        max_bytes = limits.max_bytes if state.over_bytes(limits) else None
        error = ConsumerTooSlow(state.rid, limits.max_pending, max_bytes=max_bytes)
        # The consumer is too slow: its request ends, or its whole batch if read whole.
        # A finished request's producer has forgotten it: no abort to report for it.
        told = self._abort_live((state,), error)
        if finished and state.rid in told:
            told.remove(state.rid)
        self._tell(told, defer=True)

    def merge_failed(self, state: RequestState, exc: Exception, finished: bool) -> None:
        """``merge()`` raised while delivering to ``state``: fail that request alone.

        The producer did not fail it and does not know, so unless that was its last
        output, ``on_abort`` tells it to stop.
        """
        if not state.live:
            return
        logger.error(
            "merge() raised for request %r; the request fails, the producer goes on",
            state.rid,
            exc_info=exc,
        )
        self.end(state, ProducerError(state.rid, exc), tell=not finished, defer=True)

    def fail_all(self, exc: BaseException) -> int:
        """Fail every live request with its own :class:`~tether.ProducerError`."""
        live = [state for state in self.entries.values() if state.live]
        return sum(
            len(self._close((state,), ProducerError(state.rid, exc), None)) for state in live
        )

    def expire(self, states: tuple[RequestState, ...], timeout: float) -> None:
        """A deadline passed (a timer callback)."""
        live = [state for state in states if state.live]
        if live:
            self.abort(live, RequestTimeout(live[0].rid, timeout), defer=False)

    def abort_from_gc(self, states: Sequence[RequestState]) -> None:
        """Abort the states of a consumer that was dropped without being closed
        (called from ``__del__``, maybe on another thread, maybe with the loop gone)."""
        error = Aborted(states[0].rid, AbortReason.CANCELLED)
        loop = self._loop
        if self._thread == threading.get_ident() and loop is not None and not loop.is_closed():
            self.abort(states, error, defer=True)
            return
        try:
            self.require_loop().call_soon_threadsafe(
                functools.partial(self.abort, states, error, defer=True)
            )
        except RuntimeError:  # the loop is gone: free the entries, nobody is listening
            self._close(states, error, AbortReason.CANCELLED)

    async def close(self, drain_timeout: float) -> None:
        """Stop admitting; wait up to ``drain_timeout`` for the table to empty; abort
        the rest (reason ``server``); wait (bounded) for asynchronous ``on_abort``."""
        self.closed = True
        if self.entries and drain_timeout > 0:
            if self._idle is None:
                self._idle = asyncio.Event()
            idle = self._idle
            try:
                async with asyncio.timeout(drain_timeout):
                    await idle.wait()
            except TimeoutError:
                pass
            finally:
                if not self.entries:
                    self._idle = None
        for state in list(self.entries.values()):
            if state.live:
                error = Aborted(state.rid, AbortReason.SERVER, "the server is shutting down")
                group = state.group
                if group is not None and group.keep_going:  # each ends in its own place
                    self._tell(self._close((state,), error, AbortReason.SERVER), defer=False)
                else:
                    self.abort(group.states if group is not None else (state,), error, defer=False)
        await self._notifier.wait()

    def _close(
        self, states: Iterable[RequestState], error: TetherError, reason: AbortReason | None
    ) -> list[str]:
        """Free, count and end each of ``states`` still live with ``error``: aborted
        under ``reason`` (their unread outputs dropped), or failed when ``reason`` is
        None (what they delivered before stays readable). Calls nobody's code: the
        rids it ended are returned, for :meth:`_tell` once the table is consistent."""
        aborted = reason is not None
        ended: list[str] = []
        for state in states:
            if not state.live:
                continue  # ended meanwhile
            ended.append(state.rid)
            if reason is None:
                self._failed += 1
            else:
                self._aborted[reason] += 1
            self._release(state, error, reason)
            state.end(error, drop=aborted)
            group = state.group
            if group is not None:
                if aborted and not group.split:
                    group.drop(state.index)
                group.record(state)
        return ended

    def _release(self, state: RequestState, error: TetherError | None, why: str | None) -> None:
        state.live = False
        if self.entries.get(state.rid) is state:
            del self.entries[state.rid]
        self._total.append(observe_end(self.observers, state, error, why, now() - state.opened_at))
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        group = state.group
        if group is not None:
            group.remaining -= 1
            if group.remaining == 0:
                group.live = False
                # Break the group <-> states cycle: a finished batch is freed by
                # reference counting, not left to the cyclic garbage collector.
                group.states = ()
                if group.timer is not None:
                    group.timer.cancel()
                    group.timer = None
        if self._idle is not None and not self.entries:
            self._idle.set()

    def taken(self, rid: str) -> bool:
        """Whether ``rid`` cannot be opened now: live, or freed but not yet reported to
        ``on_abort`` (see :class:`~tether._notify.Notifier`)."""
        return rid in self.entries or self._notifier.holds(rid)

    def _tell(self, rids: list[str], defer: bool) -> None:
        self._notifier.tell(rids, self._loop if defer else None)

    # -- figures ------------------------------------------------------------------------

    def stats(self) -> RegistryStats:
        """A frozen snapshot of the counters and timing summaries."""
        return RegistryStats(
            opened=self._opened,
            finished=self._finished,
            failed=self._failed,
            aborted=MappingProxyType({str(reason): n for reason, n in self._aborted.items()}),
            late_outputs=self.late,
            in_flight=len(self.entries),
            max_in_flight=self.max_in_flight,
            closed=self.closed,
            time_to_first_output=Summary.of(self.ttfo),
            total_time=Summary.of(self._total),
        )
