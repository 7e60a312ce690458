"""The internal table ``rid -> state`` behind ``Registry``, and the one path by which a
request ends.

:class:`Table` is what :class:`~tether.Registry` stands in front of: it admits
requests, hands out fresh ids, and ends them. Every request ends through one
method, :meth:`Table.end`, given an :class:`End` (finished, failed, or aborted
with a reason, and how far it reaches in a batch): it frees the entry, counts the
end once, closes the mailbox (which records it and wakes the consumer), tells the
observers, applies the batch rule and decides whether the producer hears of it
through ``on_abort``. Everything else that ends requests (the producer's last
output, a failure, a deadline, a slow consumer, a raising ``merge``, a finaliser,
shutdown) is a caller of it that says which :class:`End`.

``on_abort`` is called at once, except while a producer's call is under way on the
loop (:attr:`Table.steps`, shared by every registry on that loop: ``deliver``,
``deliver_many``, ``fail``, ``fail_all``, and whatever they run, sinks, ``merge``,
observers, whatever those end) or from a garbage collector's finaliser (``defer``):
then it runs soon after on the loop, once the producer's step has returned, so that
it never re-enters the producer in the middle of its step.
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

from ._end import ALONE, FINISHED, SIBLINGS, WHOLE, End, failed_sibling, wrong_loop
from ._errors import (
    Aborted,
    AbortReason,
    ConsumerTooSlow,
    InvalidRequest,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    WrongLoop,
)
from ._limits import Limits
from ._notify import Notifier, Steps, steps_of
from ._observe import Observer, observe_end
from ._state import RequestState
from ._stats import RegistryStats, Summary, sample_buffer
from .types import OnAbort

__all__ = ["Table"]

logger = logging.getLogger("tether")

now: Final = time.monotonic


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
        "_notifier",
        "_opened",
        "_prefix",
        "_total",
        "closed",
        "entries",
        "late",
        "limits",
        "loop",
        "max_in_flight",
        "observers",
        "steps",
        "thread",
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
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop requests are opened on (consumers check it on their hot path)."""
        self.thread: int | None = None
        """The thread of that loop (``threading.get_ident()``), once known."""
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
        self.steps = Steps()
        """How many producer's calls are under way on the table's loop, to any of its
        registries (the registry counts its own; shared once the loop is known):
        meanwhile ``on_abort`` waits for the loop (:meth:`end`)."""

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
        if loop is not self.loop:
            if self.entries:
                raise WrongLoop(
                    "this registry's requests run on another event loop: open them on "
                    "that loop, or give each event loop its own Registry"
                )
            self.loop = loop
            self.thread = threading.get_ident()
            old, self.steps = self.steps, steps_of(loop)
            if old is not self.steps:
                self._notifier.moved(old, self.steps, loop)
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
        loop = self.loop
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
        if loop is not self.loop:
            raise wrong_loop()
        return loop

    def check_thread(self, what: str) -> None:
        """Refuse a call that changes the table from another thread than the loop's.

        :raises WrongLoop: called from another thread.
        """
        thread = self.thread
        if thread is not None and thread != threading.get_ident():
            raise WrongLoop(
                f"{what} was called from thread {threading.current_thread().name!r}, not "
                "the thread of the registry's event loop: use the *_threadsafe methods "
                "(or loop.call_soon_threadsafe)"
            )

    # -- the end of a request ---------------------------------------------------------

    def end(self, states: Iterable[RequestState], how: End, *, defer: bool = False) -> bool:
        """End what is live of ``states`` as ``how`` says: the one path by which every
        request ends.

        Each one's entry is freed, its end counted once (finished, failed, or aborted
        under a reason), its mailbox closed (its consumer learns how and is woken) and
        the observers told. The batch rule is applied here, by ``how.reach``: a
        failure decided for one sub-request (``SIBLINGS``) aborts its live siblings,
        unless the batch keeps going, each with :func:`failed_sibling`; a consumer's
        abort (``WHOLE``) ends a batch read whole (or not yet read) with it; ``ALONE``
        ends only ``states``. Last, ``on_abort`` is called for every rid ended that the
        producer does not know of (``how.tell``; the requests an end pulls in always
        are): at once, or soon on the loop while a producer's call is under way
        (:attr:`steps`) or with ``defer`` (entered from a finaliser).

        :returns: whether any of ``states`` was live.
        """
        live = [state for state in states if state.live]
        if not live:
            return False
        error, reason = how.error, how.reason
        group = live[0].group
        others: list[RequestState] = []
        if group is not None and how.reach is WHOLE and not group.split:
            if error is not None:
                group.fail_whole(error)  # reading the batch raises it
            chosen = set(map(id, live))
            others = [state for state in group.states if state.live and id(state) not in chosen]
        told: list[str] = []
        entries, observers, total = self.entries, self.observers, self._total
        for pulled_in, batch in ((False, live), (True, others)):
            for state in batch:
                if not state.live:
                    continue  # ended meanwhile (an observer or a finaliser re-entered)
                if reason is not None:
                    self._aborted[reason] += 1
                elif error is not None:
                    self._failed += 1
                else:
                    self._finished += 1
                if entries.get(state.rid) is state:
                    del entries[state.rid]
                if how.tell or pulled_in:
                    told.append(state.rid)
                state.close(error, drop=reason is not None)
                total.append(observe_end(observers, state, error, reason, now() - state.opened_at))
        if how.reach is SIBLINGS and group is not None and not group.keep_going:
            failed = live[0].rid
            for sibling in [sibling for sibling in group.states if sibling.live]:
                assert error is not None  # (a finish reaches no sibling)
                self.end((sibling,), End(failed_sibling(sibling.rid, failed, error)), defer=defer)
        if self._idle is not None and not entries:
            self._idle.set()
        # Told only once the table is consistent again: on_abort may re-enter it. Not
        # inside a producer's call, whoever ended them there (its sink, a sink's scope,
        # merge, an observer): the producer is mid-step, and must not be re-entered.
        if told:
            self._notifier.tell(self.steps, told, self.loop if defer or self.steps.depth else None)
        return True

    def end_rid(self, rid: str, how: End) -> bool:
        """:meth:`end` the request ``rid`` if it is live; else count a late call."""
        state = self.entries.get(rid)
        if state is None:
            self.late += 1
            return False
        return self.end((state,), how)

    def too_slow(self, state: RequestState, finished: bool) -> None:
        """``state``'s backlog went over a limit (called from inside ``deliver``, so
        ``on_abort`` waits for the step to return): it ends, or its whole batch if read
        whole; a finished request's producer has forgotten it, so only the others are
        reported to ``on_abort``."""
        limits = self.limits
        if not state.offering() and state.last_was_held():
            finished = True  # (the end waited for its sink's answer: RequestState.offered)
            if state.fits(limits):
                self.end((state,), FINISHED)
                return
        max_bytes = limits.max_bytes if state.over_bytes(limits) else None
        error = ConsumerTooSlow(state.rid, limits.max_pending, max_bytes=max_bytes)
        self.end((state,), End(error, WHOLE, tell=not finished))

    def merge_failed(self, state: RequestState, exc: BaseException, finished: bool) -> None:
        """``merge()`` raised while delivering to ``state``: fail that request alone;
        unless that was its last output, ``on_abort`` tells the producer to stop, once
        its step returned."""
        finished = state.last_was_held() or finished  # (see too_slow)
        if state.live:
            logger.error(
                "merge() raised for request %r; the request fails, the producer goes on",
                state.rid,
                exc_info=exc,
            )
        else:  # (folding what a sink's answer left, after the request ended otherwise)
            logger.error(
                "merge() raised for request %r after it ended; the outputs from there on are lost",
                state.rid,
                exc_info=exc,
            )
        failure = End(ProducerError(state.rid, exc), SIBLINGS, tell=not finished)
        self.end((state,), failure)

    def fail_all(self, exc: BaseException) -> int:
        """Fail every live request with its own :class:`~tether.ProducerError`."""
        live = list(self.entries.values())
        return sum(self.end((s,), End(ProducerError(s.rid, exc), tell=False)) for s in live)

    def expire(self, states: tuple[RequestState, ...], timeout: float) -> None:
        """A deadline passed (a timer callback): what is live of ``states`` ends."""
        live = [state for state in states if state.live]
        if live:
            self.end(live, End(RequestTimeout(live[0].rid, timeout), WHOLE))

    def abort_from_gc(self, states: Sequence[RequestState]) -> None:
        """Abort the states of a consumer that was dropped without being closed
        (called from ``__del__``, maybe on another thread, maybe with the loop gone)."""
        how = End(Aborted(states[0].rid, AbortReason.CANCELLED), WHOLE)
        loop = self.loop
        if self.thread == threading.get_ident() and loop is not None and not loop.is_closed():
            self.end(states, how, defer=True)
            return
        try:
            self.require_loop().call_soon_threadsafe(
                functools.partial(self.end, states, how, defer=True)
            )
        except RuntimeError:  # the loop is gone: free the entries, nobody is listening
            self.end(states, End(how.error, WHOLE, tell=False))

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
            group = state.group  # (a keep-going batch's sub-requests each end in its place)
            reach = ALONE if group is not None and group.keep_going else WHOLE
            error = Aborted(state.rid, AbortReason.SERVER, "the server is shutting down")
            self.end((state,), End(error, reach))
        await self._notifier.wait(self.steps)

    def taken(self, rid: str) -> bool:
        """Whether ``rid`` cannot be opened now: live, or freed but not yet reported to
        ``on_abort`` (see :class:`~tether._notify.Notifier`)."""
        return rid in self.entries or self._notifier.holds(rid)

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
