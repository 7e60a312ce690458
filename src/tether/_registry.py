"""The registry: the public front of the table ``rid -> state`` that a producer delivers into.

``open()`` is a plain method: it registers the request and returns a
:class:`~tether.Stream` that already holds the state, so the producer freeing the
table entry (on finish, failure or abort) can never lose an output. The
producer-side methods never raise for a rid that is no longer in flight: they
return ``False`` and count a late output; and never raise for one that is (a
``merge`` that raises fails that request alone).

The machinery (admission, the one path by which a request ends, ``on_abort``,
the counters) is the ``Table``'s; the mailboxes' behaviour is their own
(``_state``). Everything runs on one event loop without locks; producers on
other threads use the ``*_threadsafe`` methods, which hand over to that loop.
"""

from __future__ import annotations

import asyncio
import reprlib
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

from ._batch import Batch
from ._end import FINISHED, SIBLINGS, End
from ._errors import (
    Aborted,
    AbortReason,
    BatchTooLarge,
    DuplicateRequest,
    InvalidRequest,
    ProducerError,
    WrongLoop,
    check_rid,
)
from ._limits import DEFAULT_MAX_PENDING_BYTES, Limits, approximate_size, require_synchronous
from ._observe import Observer, announce_first_output, opened
from ._scope import current_scope
from ._state import Group, RequestState, route
from ._stats import RegistryStats
from ._stream import Stream
from ._table import Table, now
from .types import Merge, OnAbort, SizeOf

__all__ = ["Registry"]

P = ParamSpec("P")
R = TypeVar("R")


class Registry:
    """The table of in-flight requests, shared by the HTTP handlers and the producer.

    :param on_abort: called with the rid of every request closed before it finished
        (client gone, consumer closed early, timeout, server abort, shutdown), exactly
        once, never for a request that finished or that the producer failed. A plain
        function is called at once, unless the request ended inside one of the
        producer's calls to any registry on the loop (``deliver``, ``deliver_many``,
        ``fail``, ``fail_all``, or a sink, ``merge`` or observer they run, whatever
        that ends): then soon after, on the loop, once the producer's step returned
        (or raised); it never re-enters the producer in the middle of its step. Calls
        come in the order the requests ended, one at a time: the requests an
        ``on_abort`` ends are told after it returns, never from inside it. A rid
        freed but not told yet cannot be opened again. A coroutine function runs as a
        task owned by the registry, bounded by ``abort_timeout``; :meth:`close` waits
        for every call. Its exceptions are logged, never raised.
    :param max_in_flight: admission limit; ``open()`` beyond it raises
        :class:`~tether.Overloaded`. ``None`` admits everything.
    :param max_pending: how many outputs may wait for a consumer that falls behind
        before the request ends with :class:`~tether.ConsumerTooSlow`. Ignored when
        ``merge`` is given.
    :param max_pending_bytes: how many bytes of outputs may wait for a consumer that
        falls behind (beyond the oldest waiting output; with ``merge``, every output
        folded into it since the consumer last read, weighed as it came: the size of a
        merge that concatenates, more than that of one that drops or sums, whose
        merged output is never weighed again) before the request ends with
        :class:`~tether.ConsumerTooSlow`:
        a count alone lets a few large outputs hold gigabytes. ``None`` lifts the bound.
        Each output that waits behind the oldest is weighed once, as it arrives, so
        the bound holds whatever the sizes (a backlog ends at the output that takes it
        over); sizes are measured only while a backlog exists, never for a consumer
        that keeps up, and not for ``result()``, which keeps the whole result by design.
    :param sizeof: how many bytes an output weighs; by default
        :func:`~tether.approximate_size` (string and bytes lengths and a word per
        value, through dicts, lists, tuples and objects: never less than a sixth of
        the output's JSON size, whatever its shape).
    :param merge: ``merge(older, newer) -> combined``, a plain function (a coroutine
        function is refused with :class:`TypeError`): folds waiting outputs together
        so that at most one waits per request, and folds deltas into the result of
        ``result()``. Without it, ``result()`` returns the last output.
    :param abort_timeout: bound, in seconds, on an asynchronous ``on_abort``.
    """

    __slots__ = ("_entries", "_limits", "_table")

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
        if merge is not None:
            require_synchronous(merge, "merge")
        if sizeof is not None:
            require_synchronous(sizeof, "sizeof")
        limits = Limits(merge, max_pending, max_pending_bytes, sizeof or approximate_size)
        self._limits = limits
        self._table = Table(
            on_abort, max_in_flight=max_in_flight, limits=limits, abort_timeout=abort_timeout
        )
        self._entries = self._table.entries  # the same dict: one lookup on the hot path

    # -- introspection -------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """How many requests are registered now."""
        return len(self._entries)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun: ``open()`` raises ``RegistryClosed``."""
        return self._table.closed

    @property
    def merge(self) -> Merge | None:
        """The merge function given to the constructor, if any."""
        return self._limits.merge

    @property
    def late_outputs(self) -> int:
        """Producer calls for a rid no longer in flight (cheaper than :meth:`stats`)."""
        return self._table.late

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def stats(self) -> RegistryStats:
        """A frozen snapshot of the counters and timing summaries."""
        return self._table.stats()

    def add_observer(self, observer: Observer) -> None:
        """Attach an :class:`~tether.Observer` (a metrics collector, a tracer) that hears
        of every request's open, first output and end; twice raises ``ValueError``."""
        table = self._table
        if observer in table.observers:
            raise ValueError(f"{observer!r} is already attached to this registry")
        table.observers = (*table.observers, observer)

    def remove_observer(self, observer: Observer) -> None:
        """Detach an observer attached by :meth:`add_observer`; nothing if it is not."""
        self._table.observers = tuple(o for o in self._table.observers if o is not observer)

    def __repr__(self) -> str:
        return f"<Registry in_flight={len(self._entries)} closed={self._table.closed}>"

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
        table = self._table
        loop = table.admit(1, timeout)
        scope = current_scope()
        if scope is not None:
            scope.check()
        if rid is None:
            rid = table.fresh_rid()
        elif table.taken(rid):
            raise DuplicateRequest(rid)
        state = RequestState(rid, 0, None, now())
        table.insert((state,))
        if table.observers or (scope is not None and scope.request_id is not None):
            opened(table.observers, (state,), scope, batch=False)
        if timeout is not None:
            state.arm(loop.call_later(timeout, table.expire, (state,), timeout))
        stream = Stream(table, state)
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
                raise InvalidRequest(f"a batch needs at least one sub-request, got {n_or_rids}")
            count = n_or_rids
            rids: list[str] | None = None
        else:
            rids = list(n_or_rids)
            count = len(rids)
            if count == 0:
                raise InvalidRequest("a batch needs at least one sub-request, got no ids")
            for rid in rids:
                check_rid(rid)
            if len(set(rids)) != count:
                raise InvalidRequest(f"a batch's ids must be distinct, got {rids!r}")
        table = self._table
        limit = table.max_in_flight
        if limit is not None and count > limit:
            raise BatchTooLarge(count, limit)
        loop = table.admit(count, timeout)
        if rids is not None:
            for rid in rids:
                if table.taken(rid):
                    raise DuplicateRequest(rid)
        scope = current_scope()
        if scope is not None:
            scope.check()
        if rids is None:
            rids = [table.fresh_rid() for _ in range(count)]
        group = Group(rids, now(), keep_going=keep_going)
        states = group.states
        table.insert(states)
        if scope is not None or table.observers:
            opened(table.observers, states, scope, batch=True)
        if timeout is not None:
            group.arm(loop.call_later(timeout, table.expire, tuple(states), timeout))
        batch = Batch(table, group)
        if scope is not None:
            scope.track(batch)
        return batch

    # -- producer side -------------------------------------------------------------

    def deliver(self, rid: str, output: Any, *, finished: bool = False) -> bool:
        """Route one output to its request; ``finished=True`` makes it the last one.

        Never raises: a ``merge`` that raises fails that one request (its consumer
        gets :class:`~tether.ProducerError`, the producer ``on_abort``), and a consumer
        that fell too far behind gets :class:`~tether.ConsumerTooSlow`.

        Call it on the registry's event loop (the one requests are opened on); a
        producer on another thread uses :meth:`deliver_threadsafe`. A call from
        elsewhere would change the state behind the loop's back and wake nobody; it
        is refused on each request's first output (one check per request, not per
        output), before anything changes.

        :returns: ``True`` if the request was in flight; ``False`` (counted as a late
            output, never raised) if it had already finished, failed or been aborted.
        :raises WrongLoop: called outside the registry's event loop (another thread,
            or another loop).
        """
        state = self._entries.get(rid)
        table = self._table
        if state is None:
            table.late += 1
            return False
        limits = self._limits
        if state.collecting and state.first_at and not finished and limits.merge is None:
            # (route()'s usual case: result() waits and the newest output wins, which
            # ends nothing and raises nothing: no step's bookkeeping around it)
            return state.put(output, limits)
        if not state.first_at:  # (refused before anything changes, the steps too)
            try:  # (the usual case without a call: the registry's own loop runs this)
                own = asyncio.get_running_loop() is table.loop
            except RuntimeError:
                own = False
            if not own:
                self._require_own_loop(rid)
        # Whatever this ends (a sink, its scope, merge, an observer), on_abort waits
        # for the producer's step to return: Table.end.
        steps = table.steps
        steps.depth += 1
        try:
            if not state.first_at:
                waited = state.first_output(now())
                table.ttfo.append(waited)
                if table.observers:
                    announce_first_output(table.observers, rid, waited)
                    if not state.live:  # an observer ended it: the output has nobody to reach
                        return True
            if finished and state.sink is not None:
                if state.offering():  # (delivered from inside the sink: the end waits for it)
                    if not state.hold(output, limits, last=True):
                        table.too_slow(state, finished)
                    return True
                # (a sink would write it alone: it goes out with the end, in one write)
                state.set_sink(None)
            try:
                fits = state.put(output, limits)
            except Exception as exc:  # merge() raised: that request fails, the producer goes on
                table.merge_failed(state, exc, finished)
                return True
            except BaseException:  # a sink's KeyboardInterrupt...: it goes on, the end settled
                state.settle_cut(limits, table, finished)
                raise
            if not state.live:
                return True  # ended inside put (merge or a finaliser re-entered): once is all
            if not fits:
                table.too_slow(state, finished)
            elif finished:
                table.end((state,), FINISHED)
            return True
        finally:
            steps.depth -= 1

    def _require_own_loop(self, rid: str) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._table.require_loop():
            raise WrongLoop(
                f"Registry.deliver({rid!r}) was called outside the registry's event loop "
                f"(from thread {threading.current_thread().name!r}): the consumer would "
                "not be woken. From another thread, use deliver_threadsafe() or "
                "deliver_many_threadsafe()."
            )

    def deliver_many(self, items: Iterable[tuple[str, Any, bool]]) -> int:
        """Deliver ``(rid, output, finished)`` triples in order; returns how many were live."""
        # deliver()'s usual case is inline in the mailbox's route(), the rest comes back
        # here: an engine step calls this once for every live request. (_producing()
        # inline: its call with *args is a tenth of a step of one request.)
        table = self._table
        steps = table.steps
        steps.depth += 1
        try:
            return route(self._entries, items, self._limits, self, table)
        finally:
            steps.depth -= 1

    def fail(self, rid: str, exc: BaseException) -> bool:
        """End a request with an error: its consumer gets :class:`~tether.ProducerError`.

        Outputs delivered before the failure still reach the consumer first.
        ``on_abort`` is not called: the producer knows. In a batch, the other
        sub-requests are aborted unless the batch was opened with ``keep_going``.

        :returns: ``True`` if the request was in flight, ``False`` (counted) otherwise.
        :raises WrongLoop: called from another thread (use :meth:`fail_threadsafe`).
        """
        self._table.check_thread("Registry.fail()")
        failure = End(ProducerError(rid, exc), SIBLINGS, tell=False)
        return self._producing(self._table.end_rid, rid, failure)

    def abort(self, rid: str, reason: AbortReason = AbortReason.SERVER) -> bool:
        """Abort a request from the server side: its consumer gets :class:`~tether.Aborted`.

        ``on_abort(rid)`` is called, as for every request closed before it finished:
        before this returns; or, called inside one of the producer's calls (from a
        sink, ``merge`` or an observer), soon after that call returned, and called
        from an ``on_abort``, once that returned (until then ``rid`` cannot be opened
        again). In a batch, the other sub-requests are aborted unless it keeps going.

        :returns: ``True`` if the request was in flight, ``False`` (counted) otherwise.
        :raises WrongLoop: called from another thread (use :meth:`abort_threadsafe`).
        """
        self._table.check_thread("Registry.abort()")
        # (on_abort runs after the entry is freed: it may re-enter the registry)
        return self._table.end_rid(rid, End(Aborted(rid, reason), SIBLINGS))

    def fail_all(self, exc: BaseException) -> int:
        """Fail every request in flight (the producer crashed); returns how many.

        Each consumer gets :class:`~tether.ProducerError` with ``exc`` as its cause;
        ``on_abort`` is not called.

        :raises WrongLoop: called from another thread.
        """
        self._table.check_thread("Registry.fail_all()")
        return self._producing(self._table.fail_all, exc)

    def _producing(self, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``call(*args, **kwargs)`` as the producer's call: whatever it ends has its
        ``on_abort`` told once the producer's step returned (``Table.end``)."""
        steps = self._table.steps
        steps.depth += 1
        try:
            return call(*args, **kwargs)
        finally:
            steps.depth -= 1

    # -- producers on other threads ------------------------------------------------------

    def deliver_threadsafe(self, rid: str, output: Any, *, finished: bool = False) -> None:
        """:meth:`deliver` from another thread: hands over to the registry's loop.

        Safe from any thread; the delivery happens on the loop soon after. Use
        :meth:`deliver_many_threadsafe` for a whole engine step: one hand-over.

        :raises WrongLoop: no request was ever opened (no loop known) or the loop closed.
        """
        self._table.require_loop().call_soon_threadsafe(
            self._deliver_positional, rid, output, finished
        )

    def deliver_many_threadsafe(self, items: Iterable[tuple[str, Any, bool]]) -> None:
        """Deliver ``(rid, output, finished)`` triples from another thread, in one hand-over.

        :raises TypeError: an item is not a triple with a hashable rid; raised here, in
            the producer's thread, and nothing of the step is handed over (on the loop,
            it would have cut the step short, unseen, past the items before it).
        """
        step = list(items)
        for index, item in enumerate(step):
            if type(item) is not tuple or len(item) != 3 or type(item[0]) is not str:
                step[index] = _triple(index, item)  # (the usual item costs one test, not this)
        self._table.require_loop().call_soon_threadsafe(self.deliver_many, step)

    def fail_threadsafe(self, rid: str, exc: BaseException) -> None:
        """:meth:`fail` from another thread."""
        self._table.require_loop().call_soon_threadsafe(self.fail, rid, exc)

    def abort_threadsafe(self, rid: str, reason: AbortReason = AbortReason.SERVER) -> None:
        """:meth:`abort` from another thread."""
        self._table.require_loop().call_soon_threadsafe(self.abort, rid, reason)

    def _deliver_positional(self, rid: str, output: Any, finished: bool) -> None:
        self.deliver(rid, output, finished=finished)

    # -- shutdown ----------------------------------------------------------------------

    async def close(self, *, drain_timeout: float = 5.0) -> None:
        """Stop admitting; let requests in flight finish for up to ``drain_timeout``
        seconds; then abort the rest (reason ``server``), so that every stream ends
        with an :class:`~tether.Aborted` error its adapter turns into a final error
        event. Waits (bounded) for asynchronous ``on_abort`` calls. Idempotent.
        """
        await self._table.close(drain_timeout)


def _triple(index: int, item: Any) -> tuple[Any, Any, Any]:
    """``item`` of a step as the triple the loop reads; refused unless it is a sequence
    of three with a hashable rid."""
    try:
        if not isinstance(item, Sequence) or isinstance(item, str | bytes):
            raise TypeError("not a sequence of three")  # (characters, keys, an iterator)
        rid, output, finished = item
        hash(rid)
        return rid, output, finished
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"deliver_many_threadsafe() takes (rid, output, finished) triples; "
            f"item {index} is {reprlib.repr(item)}: nothing of this step was delivered"
        ) from exc
