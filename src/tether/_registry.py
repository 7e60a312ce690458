"""The registry: the table ``rid -> state`` that a producer delivers into.

``open()`` is a plain method: it registers the request and returns a
:class:`~tether.Stream` that already holds the state, so the producer freeing the
table entry (on finish, failure or abort) can never lose an output. The
producer-side methods never raise for a rid that is no longer in flight: they
return ``False`` and count a late output.

Everything here runs on one event loop without locks; producers on other
threads use the ``*_threadsafe`` methods, which hand over to that loop.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Awaitable, Iterable, Sequence
from types import MappingProxyType
from typing import Any

from ._errors import (
    MAX_RID_LENGTH,
    Aborted,
    AbortReason,
    BatchTooLarge,
    ConsumerTooSlow,
    DuplicateRequest,
    InvalidRequestId,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    TetherError,
)
from ._scope import current_scope
from ._state import (
    DEFAULT_MAX_PENDING_BYTES,
    NOTHING,
    Group,
    RequestState,
    approximate_size,
    wake,
)
from ._stats import RegistryStats, Summary, sample_buffer
from ._stream import Batch, Stream
from .types import Merge, OnAbort, SizeOf

__all__ = ["Registry"]

logger = logging.getLogger("tether")

_now = time.monotonic

_UNSAFE_IN_RID = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Control characters (log and header injection) and lone surrogates (no encoder takes them)."""


def check_rid(rid: object) -> None:
    """Refuse a client-chosen request id that is not a valid id.

    :raises InvalidRequestId: ``rid`` is not a ``str``, is empty, is longer than
        ``MAX_RID_LENGTH``, or holds a control character or a lone surrogate.
    """
    if not isinstance(rid, str):
        raise InvalidRequestId(rid, f"a request id is a str, not {type(rid).__name__}")
    if not rid:
        raise InvalidRequestId(rid, "a request id cannot be empty")
    if len(rid) > MAX_RID_LENGTH:
        raise InvalidRequestId(rid, f"a request id has at most {MAX_RID_LENGTH} characters")
    if _UNSAFE_IN_RID.search(rid) is not None:
        raise InvalidRequestId(rid, "a control character or a lone surrogate is not allowed")


class Registry:
    """The table of in-flight requests, shared by the HTTP handlers and the producer.

    :param on_abort: called with the rid of every request closed before it finished
        (client gone, consumer closed early, timeout, server abort, shutdown), exactly
        once, never for a request that finished or that the producer failed. A plain
        function is called at once; a coroutine function runs as a task owned by the
        registry, bounded by ``abort_timeout``. Its exceptions are logged, never raised.
    :param max_in_flight: admission limit; ``open()`` beyond it raises
        :class:`~tether.Overloaded`. ``None`` admits everything.
    :param max_pending: how many outputs may wait for a consumer that falls behind
        before the request ends with :class:`~tether.ConsumerTooSlow`. Ignored when
        ``merge`` is given.
    :param max_pending_bytes: how many bytes of outputs may wait for a consumer that
        falls behind (beyond the oldest waiting output; with ``merge``, the size of the
        merged output) before the request ends with :class:`~tether.ConsumerTooSlow`:
        a count alone lets a few large outputs hold gigabytes. ``None`` lifts the bound.
        Sizes are measured only while a backlog exists, never for a consumer that keeps
        up, and not for ``result()``, which keeps the whole result by design.
    :param sizeof: how many bytes an output weighs; by default
        :func:`~tether.approximate_size` (string and bytes lengths, summed through
        dicts, lists and tuples).
    :param merge: ``merge(older, newer) -> combined``: folds waiting outputs together
        so that at most one waits per request, and folds deltas into the result of
        ``result()``. Without it, ``result()`` returns the last output.
    :param abort_timeout: bound, in seconds, on an asynchronous ``on_abort``.
    """

    def __init__(
        self,
        on_abort: OnAbort | None = None,
        *,
        max_in_flight: int | None = None,
        max_pending: int = 1024,
        max_pending_bytes: int | None = DEFAULT_MAX_PENDING_BYTES,
        sizeof: SizeOf | None = None,
        merge: Merge | None = None,
        abort_timeout: float = 5.0,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 or None, got {max_in_flight}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if max_pending_bytes is not None and max_pending_bytes < 1:
            raise ValueError(
                f"max_pending_bytes must be at least 1 or None, got {max_pending_bytes}"
            )
        self._max_pending_bytes = max_pending_bytes
        self._sizeof: SizeOf = sizeof or approximate_size
        self._on_abort = on_abort
        self._max_in_flight = max_in_flight
        self._max_pending = max_pending
        self._merge = merge
        self._abort_timeout = abort_timeout
        self._table: dict[str, RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._closed = False
        self._idle: asyncio.Event | None = None
        self._abort_tasks: set[asyncio.Task[None]] = set()
        self._prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)
        self._opened = 0
        self._finished = 0
        self._failed = 0
        self._late = 0
        self._aborted: collections.Counter[str] = collections.Counter()
        self._ttfo = sample_buffer()
        self._total = sample_buffer()

    # -- introspection -------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """How many requests are registered now."""
        return len(self._table)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun: ``open()`` raises ``RegistryClosed``."""
        return self._closed

    @property
    def merge(self) -> Merge | None:
        """The merge function given to the constructor, if any."""
        return self._merge

    def __contains__(self, rid: object) -> bool:
        return rid in self._table

    def stats(self) -> RegistryStats:
        """A frozen snapshot of the counters and timing summaries."""
        return RegistryStats(
            opened=self._opened,
            finished=self._finished,
            failed=self._failed,
            aborted=MappingProxyType({str(reason): n for reason, n in self._aborted.items()}),
            late_outputs=self._late,
            in_flight=len(self._table),
            max_in_flight=self._max_in_flight,
            closed=self._closed,
            time_to_first_output=Summary.of(self._ttfo),
            total_time=Summary.of(self._total),
        )

    def __repr__(self) -> str:
        return f"<Registry in_flight={len(self._table)} closed={self._closed}>"

    # -- consumer side: opening --------------------------------------------------

    def open(self, rid: str | None = None, *, timeout: float | None = None) -> Stream:
        """Register one request and return the :class:`~tether.Stream` that reads it.

        Call it in the handler *before* handing the rid to the producer: the stream
        already holds the request's state, so nothing the producer does afterwards
        can be lost. Inside a :class:`~tether.RequestScope` the stream is tracked by
        that scope and closed when the HTTP request ends.

        :param rid: the request id; ``None`` (the default) makes a fresh one, never
            equal to a live rid. A client-chosen id shares the table with fresh ones
            but can never take a live entry's place: a live id is refused, and a fresh
            id skips whatever a client chose.
        :param timeout: a deadline in seconds; when it passes the request is aborted
            and its consumer gets :class:`~tether.RequestTimeout`.
        :raises InvalidRequestId: ``rid`` is not a valid id (see ``InvalidRequestId``).
        :raises DuplicateRequest: ``rid`` is already in flight.
        :raises Overloaded: ``max_in_flight`` requests are already in flight.
        :raises RegistryClosed: :meth:`close` has begun.
        :raises Aborted: the current request scope's client already disconnected.
        """
        if rid is not None:
            check_rid(rid)
        loop = self._admit(1, timeout)
        scope = current_scope()
        if scope is not None:
            scope.check()
        if rid is None:
            rid = self._fresh_rid()
        elif rid in self._table:
            raise DuplicateRequest(rid)
        state = RequestState(self, rid, 0, None, _now())
        self._table[rid] = state
        self._opened += 1
        if timeout is not None:
            state.timer = loop.call_later(timeout, self._expire, (state,), timeout)
        stream = Stream(state)
        if scope is not None:
            scope.track(stream)
        return stream

    def open_batch(
        self,
        n_or_rids: int | Sequence[str],
        *,
        timeout: float | None = None,
        keep_going: bool = False,
    ) -> Batch:
        """Register every sub-request of a batch, all or none; return its :class:`~tether.Batch`.

        :param n_or_rids: how many sub-requests (fresh ids), or their ids.
        :param timeout: one deadline, in seconds, for the whole batch.
        :param keep_going: when ``False`` (the default), the first sub-request that
            fails or is aborted aborts the others and its error is raised to the
            consumer; when ``True``, the others go on and the error takes that
            sub-request's place in the results.
        :raises ValueError: an empty batch, or the same id twice.
        :raises InvalidRequestId: an id is not a valid id (nothing is registered).
        :raises DuplicateRequest: an id is already in flight (nothing is registered).
        :raises BatchTooLarge: the batch is larger than ``max_in_flight``: it could never
            be admitted.
        :raises Overloaded: the batch does not fit under ``max_in_flight`` now.
        :raises RegistryClosed: :meth:`close` has begun.
        """
        if isinstance(n_or_rids, int):
            if n_or_rids < 1:
                raise ValueError(f"a batch needs at least one sub-request, got {n_or_rids}")
            count = n_or_rids
            rids: list[str] | None = None
        else:
            rids = list(n_or_rids)
            count = len(rids)
            if count == 0:
                raise ValueError("a batch needs at least one sub-request, got no ids")
            for rid in rids:
                check_rid(rid)
            if len(set(rids)) != count:
                raise ValueError(f"a batch's ids must be distinct, got {rids!r}")
        limit = self._max_in_flight
        if limit is not None and count > limit:
            raise BatchTooLarge(count, limit)
        loop = self._admit(count, timeout)
        if rids is not None:
            for rid in rids:
                if rid in self._table:
                    raise DuplicateRequest(rid)
        scope = current_scope()
        if scope is not None:
            scope.check()
        if rids is None:
            rids = [self._fresh_rid() for _ in range(count)]
        states: list[RequestState] = []
        group = Group(states, keep_going=keep_going)
        opened_at = _now()
        table = self._table
        for index, rid in enumerate(rids):
            state = RequestState(self, rid, index, group, opened_at)
            states.append(state)
            table[rid] = state  # every rid was checked absent above: nothing is overwritten
        group.remaining = count
        self._opened += count
        if timeout is not None:
            group.timer = loop.call_later(timeout, self._expire, tuple(states), timeout)
        batch = Batch(self, group)
        if scope is not None:
            scope.track(batch)
        return batch

    def _fresh_rid(self) -> str:
        # A client may have chosen the next fresh id already (the prefix is visible
        # in every rid handed out): skip it rather than take its entry.
        table = self._table
        while True:
            rid = f"{self._prefix}-{next(self._ids)}"
            if rid not in table:
                return rid

    def _admit(self, count: int, timeout: float | None) -> asyncio.AbstractEventLoop:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout}")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._thread = threading.get_ident()
        if self._closed:
            raise RegistryClosed()
        limit = self._max_in_flight
        if limit is not None and len(self._table) + count > limit:
            raise Overloaded(limit)
        return loop

    # -- producer side -------------------------------------------------------------

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> bool:
        """Route one output to its request; ``finished=True`` makes it the last one.

        :returns: ``True`` if the request was in flight; ``False`` (counted as a late
            output, never raised) if it had already finished, failed or been aborted.
        """
        state = self._table.get(rid)
        if state is None:
            self._late += 1
            return False
        if not state.first_at:
            state.first_at = now = _now()
            self._ttfo.append(now - state.opened_at)
        merge = self._merge
        # Only merge() can raise below (a try costs nothing until it catches): it fails
        # that one request, and the producer's step goes on.
        try:
            if state.collect:
                acc = state.acc
                state.acc = output if merge is None or acc is NOTHING else merge(acc, output)
                if finished:
                    self._finish(state)
                return True
            group = state.group
            if group is None or group.split:
                pending = state.pending
                if not pending:
                    pending.append(output)
                elif merge is not None:
                    pending[-1] = merged = merge(pending[-1], output)
                    if self._over_budget(state, merged, merged=True):
                        self._too_slow(state, finished)
                        return True
                elif len(pending) < self._max_pending:
                    pending.append(output)
                    if self._over_budget(state, output, merged=False):
                        self._too_slow(state, finished)
                        return True
                else:
                    self._too_slow(state, finished)
                    return True
                if finished:
                    self._finish(state)
                waiter = state.waiter
                if waiter is not None:
                    state.waiter = None
                    wake(waiter)
                if group is None:
                    return True
            else:
                pending_pairs = group.pending
                if state.gen != group.gen:
                    state.gen = group.gen
                    state.npending = 1
                    state.nbytes = 0
                    state.pos = len(pending_pairs)
                    pending_pairs.append((state.index, output))
                elif merge is not None:
                    pos = state.pos
                    merged = merge(pending_pairs[pos][1], output)
                    pending_pairs[pos] = (state.index, merged)
                    if self._over_budget(state, merged, merged=True):
                        self._too_slow(state, finished)
                        return True
                elif state.npending < self._max_pending:
                    state.npending += 1
                    state.pos = len(pending_pairs)
                    pending_pairs.append((state.index, output))
                    if self._over_budget(state, output, merged=False):
                        self._too_slow(state, finished)
                        return True
                else:
                    self._too_slow(state, finished)
                    return True
                if finished:
                    self._finish(state)
        except Exception as exc:
            self._merge_failed(state, exc, finished)
            return True
        waiter = group.waiter
        if waiter is not None:
            group.waiter = None
            wake(waiter)
        return True

    def fail(self, rid: str, exc: BaseException) -> bool:
        """End a request with an error: its consumer gets :class:`~tether.ProducerError`.

        Outputs delivered before the failure still reach the consumer first.
        ``on_abort`` is not called: the producer knows. In a batch, the other
        sub-requests are aborted unless the batch was opened with ``keep_going``.

        :returns: ``True`` if the request was in flight, ``False`` (counted) otherwise.
        """
        state = self._table.get(rid)
        if state is None:
            self._late += 1
            return False
        self._failed += 1
        self._end(state, ProducerError(rid, exc), AbortReason.FAILED_SIBLING, defer=True)
        return True

    def abort(self, rid: str, reason: AbortReason = AbortReason.SERVER) -> bool:
        """Abort a request from the server side: its consumer gets :class:`~tether.Aborted`.

        ``on_abort(rid)`` is called, as for every request closed before it finished.

        :returns: ``True`` if the request was in flight, ``False`` (counted) otherwise.
        """
        state = self._table.get(rid)
        if state is None:
            self._late += 1
            return False
        self._aborted[reason] += 1
        self._end(state, Aborted(rid, reason), AbortReason.FAILED_SIBLING, defer=False)
        self._notify(rid, defer=False)  # after the entry is freed: on_abort may re-enter
        return True

    def fail_all(self, exc: BaseException) -> int:
        """Fail every request in flight (the producer crashed); returns how many.

        Each consumer gets :class:`~tether.ProducerError` with ``exc`` as its cause.
        """
        failed = 0
        for state in list(self._table.values()):
            if state.live:
                failed += 1
                self._failed += 1
                self._end(state, ProducerError(state.rid, exc), None, defer=True)
        return failed

    # -- producers on other threads ------------------------------------------------------

    def deliver_threadsafe(self, rid: str, output: Any, *, finished: bool = False) -> None:
        """:meth:`deliver` from another thread: hands over to the registry's loop.

        Safe from any thread; the delivery happens on the loop soon after. Use
        :meth:`deliver_many_threadsafe` for a whole engine step: one hand-over.

        :raises RuntimeError: no request was ever opened (no loop known) or the loop closed.
        """
        self._require_loop().call_soon_threadsafe(self._deliver_positional, rid, output, finished)

    def deliver_many_threadsafe(self, items: Iterable[tuple[str, Any, bool]]) -> None:
        """Deliver ``(rid, output, finished)`` triples from another thread, in one hand-over."""
        self._require_loop().call_soon_threadsafe(self.deliver_many, list(items))

    def deliver_many(self, items: Iterable[tuple[str, Any, bool]]) -> int:
        """Deliver ``(rid, output, finished)`` triples in order; returns how many were live."""
        deliver = self.deliver
        return sum(deliver(rid, output, finished=finished) for rid, output, finished in items)

    def fail_threadsafe(self, rid: str, exc: BaseException) -> None:
        """:meth:`fail` from another thread."""
        self._require_loop().call_soon_threadsafe(self.fail, rid, exc)

    def abort_threadsafe(self, rid: str, reason: AbortReason = AbortReason.SERVER) -> None:
        """:meth:`abort` from another thread."""
        self._require_loop().call_soon_threadsafe(self.abort, rid, reason)

    def _deliver_positional(self, rid: str, output: Any, finished: bool) -> None:
        self.deliver(rid, output, finished=finished)

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise RuntimeError(
                "no request was opened on this registry yet: no loop to hand over to"
            )
        return loop

    # -- shutdown ----------------------------------------------------------------------

    async def close(self, *, drain_timeout: float = 5.0) -> None:
        """Stop admitting; let requests in flight finish for up to ``drain_timeout``
        seconds; then abort the rest (reason ``server``), so that every stream ends
        with an :class:`~tether.Aborted` error its adapter turns into a final error
        event. Waits (bounded) for asynchronous ``on_abort`` calls. Idempotent.
        """
        self._closed = True
        if self._table and drain_timeout > 0:
            if self._idle is None:
                self._idle = asyncio.Event()
            idle = self._idle
            try:
                async with asyncio.timeout(drain_timeout):
                    await idle.wait()
            except TimeoutError:
                pass
            finally:
                if not self._table:
                    self._idle = None
        for state in list(self._table.values()):
            if state.live:
                self._aborted[AbortReason.SERVER] += 1
                error = Aborted(state.rid, AbortReason.SERVER, "the server is shutting down")
                self._end(state, error, AbortReason.SERVER, defer=False)
                self._notify(state.rid, defer=False)
        if self._abort_tasks:
            await asyncio.wait(set(self._abort_tasks), timeout=self._abort_timeout)

    # -- ending requests (internal) ---------------------------------------------------

    def _release(self, state: RequestState) -> None:
        state.live = False
        del self._table[state.rid]
        self._total.append(_now() - state.opened_at)
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        group = state.group
        if group is not None:
            group.remaining -= 1
            if group.remaining == 0:
                # Break the group <-> states cycle: a finished batch is freed by
                # reference counting, not left to the cyclic garbage collector.
                group.states = ()
                if group.timer is not None:
                    group.timer.cancel()
                    group.timer = None
        if self._idle is not None and not self._table:
            self._idle.set()

    def _finish(self, state: RequestState) -> None:
        self._finished += 1
        self._release(state)
        if state.collect:
            wake_consumer(state)

    def _end(
        self,
        state: RequestState,
        error: TetherError,
        sibling_reason: AbortReason | None,
        *,
        defer: bool,
    ) -> None:
        """End one live request with an error; in a batch, apply the batch's rule.

        Every sub-request records how it ended (``state.error``) whether or not its
        batch was split, so that a batch read through its sub-streams later reports
        the same failure as one read whole.
        """
        self._release(state)
        state.error = error
        if isinstance(error, Aborted):
            state.pending = []  # an aborted request's unread outputs are dropped
        group = state.group
        if group is None:
            pass
        elif group.keep_going or sibling_reason is None:
            if group.errors is None:
                group.errors = {}
            group.errors[state.index] = error
            if group.split:
                pass
            elif group.keep_going:
                # the error takes the sub-request's place in arrival order
                group.pending.append((state.index, error))
            elif group.error is None:
                group.error = error
        else:
            self._abort_group(group, error, sibling_reason, defer=defer, ended=state)
        wake_consumer(state)

    def _abort_group(
        self,
        group: Group,
        error: TetherError,
        reason: AbortReason,
        *,
        defer: bool,
        ended: RequestState | None = None,
    ) -> None:
        """Abort every live sub-request of ``group`` with ``error`` (the batch failed).

        What the ones that ended before delivered stays readable (the failing one's,
        if it failed rather than was aborted, and the finished ones'); the outputs of
        the ones aborted now are dropped, as an aborted stream's are.
        """
        group.error = error
        dropped: set[int] = set()
        if ended is not None and isinstance(ended.error, Aborted):
            dropped.add(ended.index)
        for sibling in group.states:
            if sibling.live:
                self._aborted[reason] += 1
                self._release(sibling)
                sibling.error = error
                sibling.pending = []
                dropped.add(sibling.index)
                self._notify(sibling.rid, defer=defer)
            wake(sibling.waiter)
            sibling.waiter = None
        if dropped and group.pending:
            group.drop(dropped)
        wake(group.waiter)
        group.waiter = None

    def _abort_states(
        self, states: Sequence[RequestState], error: TetherError, *, defer: bool
    ) -> bool:
        """Abort the live ones of ``states`` (one consumer's) with ``error``; for consumers."""
        reason = error.reason if isinstance(error, Aborted) else AbortReason.SERVER
        live = [state for state in states if state.live]
        if not live:
            return False
        group = live[0].group
        if group is not None and not group.split:
            self._abort_group(group, error, reason, defer=defer)
            return True
        for state in live:
            self._aborted[reason] += 1
            self._release(state)
            self._notify(state.rid, defer=defer)
            state.error = error
            state.pending = []
            wake_consumer(state)
        return True

    def _over_budget(self, state: RequestState, output: Any, *, merged: bool) -> bool:
        """Count ``output`` against the request's byte budget (only called while a
        backlog exists); whether the backlog is now over it."""
        budget = self._max_pending_bytes
        if budget is None:
            return False
        size = self._sizeof(output)
        state.nbytes = size if merged else state.nbytes + size
        return state.nbytes > budget

    def _too_slow(self, state: RequestState, finished: bool) -> None:
        # Called from inside deliver(): on_abort must not re-enter the producer.
        budget = self._max_pending_bytes
        if budget is not None and state.nbytes > budget:
            error = ConsumerTooSlow(state.rid, self._max_pending, max_bytes=budget)
        else:
            error = ConsumerTooSlow(state.rid, self._max_pending)
        if finished:
            # The producer is done with this rid and has forgotten it: the request ends
            # with the error, but it is no abort to report (on_abort never hears of a
            # finished request); in a batch, the batch's rule applies to the others.
            self._aborted[AbortReason.CONSUMER_TOO_SLOW] += 1
            self._end(state, error, AbortReason.CONSUMER_TOO_SLOW, defer=True)
            return
        group = state.group
        states = group.states if group is not None and not group.split else (state,)
        self._abort_states(states, error, defer=True)

    def _merge_failed(self, state: RequestState, exc: Exception, finished: bool) -> None:
        """``merge()`` raised while delivering to ``state``: fail that request alone.

        The producer does not know (it did not fail the request), so unless that was its
        last output, ``on_abort`` tells it to stop; a batch applies its rule to the rest.
        """
        if not state.live:
            return
        logger.error(
            "merge() raised for request %r; the request fails, the producer goes on",
            state.rid,
            exc_info=exc,
        )
        self._failed += 1
        self._end(state, ProducerError(state.rid, exc), AbortReason.FAILED_SIBLING, defer=True)
        if not finished:
            self._notify(state.rid, defer=True)

    def _expire(self, states: tuple[RequestState, ...], timeout: float) -> None:
        live = [state for state in states if state.live]
        if live:
            self._abort_states(live, RequestTimeout(live[0].rid, timeout), defer=False)

    def _abort_from_gc(self, states: Sequence[RequestState]) -> None:
        """Abort the states of a consumer that was dropped without being closed."""
        loop = self._loop
        if self._thread == threading.get_ident() and loop is not None and not loop.is_closed():
            self._abort_states(states, Aborted(states[0].rid, AbortReason.CANCELLED), defer=True)
            return
        error = Aborted(states[0].rid, AbortReason.CANCELLED)
        try:
            self._require_loop().call_soon_threadsafe(
                functools.partial(self._abort_states, states, error, defer=True)
            )
        except RuntimeError:  # the loop is gone: free the entries, nobody is listening
            for state in states:
                if state.live:
                    self._aborted[AbortReason.CANCELLED] += 1
                    self._release(state)

    # -- on_abort -----------------------------------------------------------------------

    def _notify(self, rid: str, *, defer: bool) -> None:
        if self._on_abort is None:
            return
        if defer and self._loop is not None:
            self._loop.call_soon(self._call_on_abort, rid)
        else:
            self._call_on_abort(rid)

    def _call_on_abort(self, rid: str) -> None:
        callback = self._on_abort
        assert callback is not None  # only scheduled when set
        try:
            result = callback(rid)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)
            return
        if inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(self._await_on_abort(rid, result))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

    async def _await_on_abort(self, rid: str, awaitable: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self._abort_timeout):
                await awaitable
        except TimeoutError:
            logger.error("on_abort(%r) took longer than %gs; abandoned", rid, self._abort_timeout)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)


def wake_consumer(state: RequestState) -> None:
    """Wake whoever reads ``state``: its own waiter and, in a batch, the batch's."""
    waiter = state.waiter
    if waiter is not None:
        state.waiter = None
        wake(waiter)
    group = state.group
    if group is not None:
        waiter = group.waiter
        if waiter is not None:
            group.waiter = None
            wake(waiter)
