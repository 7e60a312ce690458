"""The consumer loop that :class:`~tether.Stream` and :class:`~tether.Batch` share.

A consumer reads one mailbox (a request's state, or a batch's group: see
``_state``) through one loop: take what is ready, else raise the mailbox's error,
else end if nothing more can come, else park on a future that the producer's
``put`` resolves. What differs between a stream and a batch is only which mailbox
that is and what ``result()`` folds.

Consumers are classes with ``__anext__``, not async generators, so that closing is
deterministic: ``aclose()`` frees whatever is unfinished and calls ``on_abort`` at
once, cancellation of the consuming task is an abort, and a consumer dropped
without being closed is cleaned up by ``__del__`` with a ``ResourceWarning``
instead of by a generator finaliser that runs later, elsewhere or never.

Adapters read with :meth:`Consumer.next_ready`: every ready output at once, for one write.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, Self

from ._end import WHOLE, End
from ._errors import Aborted, AbortReason, ConcurrentRead
from ._idle import IdleDeadline
from ._scope import waiter_cancelled
from ._state import NOTHING, Group, RequestState

_thread_id = threading.get_ident
if sys.version_info >= (3, 12):
    _current_task = asyncio.current_task  # (in C)
else:
    # 3.11's current_task(loop) is a Python function around this dict's get(loop): asked
    # per wait, the function's frame was 3 % of an output's instructions (bench.core).
    _tasks: dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] = vars(asyncio.tasks)[
        "_current_tasks"
    ]
    _current_task = _tasks.get

if TYPE_CHECKING:
    from ._table import Table
    from .types import Merge

__all__ = ["Consumer", "fold"]

EMPTY: Final[list[Any]] = []


def _idle(consumer: weakref.ref[Consumer]) -> None:
    """A timed wait's deadline passed. The timer holds its consumer weakly: a consumer
    dropped while its timer is armed is freed (and its request aborted) at once, not
    when it fires."""
    alive = consumer()
    if alive is not None:
        alive._on_idle()  # noqa: SLF001 (this module's own consumer)


def fold(merge: Merge | None, acc: Any, output: Any) -> Any:
    """``acc`` and a newer ``output`` as one result: merged, or the newer one."""
    if merge is None or acc is NOTHING:
        return output
    return merge(acc, output)


class Consumer:
    """What :class:`~tether.Stream` and :class:`~tether.Batch` share: the reading loop,
    closing, cancelling and waiting."""

    __slots__ = (
        "__weakref__",
        "_box",
        "_buf",
        "_claimed",
        "_closed",
        "_collecting",
        "_idle",
        "_pos",
        "_reading",
        "_states",
        "_table",
    )

    def __init__(
        self, table: Table, states: Sequence[RequestState], box: RequestState | Group | None
    ) -> None:
        self._table = table
        self._states = states
        # The mailbox read; None until the first read decides it (see _first_read).
        self._box = box
        self._buf: list[Any] = EMPTY
        self._pos = 0
        self._closed = False
        self._claimed = False  # a response (or a resumable stream's log) answers with it
        self._collecting = False  # result() put the requests in collect mode
        # A task is inside a read that waits (result(), or parked until it resumes):
        # any other task's read is refused before it touches anything (ConcurrentRead).
        self._reading = False
        # The deadline of timed waits (next_ready(timeout=...)) and its one timer,
        # made at the first timed wait.
        self._idle: IdleDeadline | None = None

    def _first_read(self) -> RequestState | Group:
        """Decide the mailbox at the first read (a batch is read whole or split)."""
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """Whether no request of this consumer is in flight any more."""
        return not any(state.live for state in self._states)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (a response ends with it): a later read
        ends at once, so nothing is left to answer with."""
        return self._closed

    def claim(self) -> bool:
        """Claim this for the one response that answers with it (an adapter's
        ``respond()``, a :class:`~tether.http.Exchange`, a resumable stream's log):
        ``True`` the first time, ``False`` once claimed or closed. A response takes a
        stream once; reading it before is not a claim."""
        if self._claimed or self._closed:
            return False
        self._claimed = True
        return True

    @property
    def exhausted(self) -> bool:
        """Whether everything was read and it all ended cleanly: the next read ends
        the iteration (adapters use it to send the terminal frame with the last outputs)."""
        box = self._box
        return (
            box is not None
            and not box.live
            and box.error is None
            and not box.pending
            and self._pos >= len(self._buf)
        )

    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """Abort whatever is unfinished, now (synchronous; for adapters and scopes).

        ``on_abort`` is called for each unfinished rid; a consumer waiting on this
        stream gets :class:`~tether.Aborted` with ``reason``.

        :returns: whether anything was still in flight.
        """
        states = self._states
        for state in states:
            if state.live:
                table = self._table
                table.check_thread(f"{type(self).__name__}.cancel()")
                error = Aborted(states[0].rid, reason)
                return table.end(states, End(error, WHOLE))
        return False  # the common case at the end of every response: nothing to build

    async def aclose(self) -> None:
        """Close the consumer: unfinished requests are freed and ``on_abort`` is
        called for each, exactly once. Idempotent; later reads end the iteration.

        :raises WrongLoop: called from another thread while a request is unfinished
            (refused before anything changes: the reader goes on).
        """
        # cancel() first: it refuses another thread before anything is changed, and
        # nothing awaits in between, so the reader it wakes finds the stream closed.
        self.cancel(AbortReason.CANCELLED)
        self._closed = True
        self._buf = EMPTY
        if self._idle is not None:  # (_stop_idle(), inline: once per response)
            self._idle.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()  # however the block ended

    def __del__(self) -> None:
        if getattr(self, "_closed", False):  # (aclose() ended every request of it)
            return
        states = getattr(self, "_states", ())
        if any(state.live for state in states):
            warnings.warn(
                f"{self!r} was dropped without being closed; its request was aborted. "
                "Use 'async with', aclose(), or a RequestScope.",
                ResourceWarning,
                source=self,
                stacklevel=1,
            )
            self._table.abort_from_gc(states)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        """The next output (a :class:`~tether.Stream`) or ``(index, output)`` pair (a
        :class:`~tether.Batch`); ``StopAsyncIteration`` after the last.

        :raises ProducerError: the producer failed the request (after its earlier outputs).
        :raises Aborted: the request was aborted (timeout, disconnect, server, too slow).
        """
        buf, pos = self._buf, self._pos
        if pos < len(buf):
            self._pos = pos + 1
            return buf[pos]
        if self._reading:  # (another task owns what woke it, even before it resumes)
            raise ConcurrentRead(self)
        box = self._box or self._first_read()
        woken = False  # (a task woken here runs in the thread its wait was checked in)
        while True:
            if self._closed:
                raise StopAsyncIteration
            if box.pending:
                if not woken:
                    table = self._table
                    if table.thread != _thread_id():  # (before anything is taken)
                        table.check_thread("async for")
                items = box.take()
                if not items:
                    continue  # only an aborted sub-request's outputs waited
                if len(items) > 1:  # (an exhausted buffer needs no reset)
                    self._buf = items
                    self._pos = 1
                return items[0]
            if box.error is not None:
                raise box.error.with_traceback(None)
            if not box.live:
                raise StopAsyncIteration
            if box.waiter is not None:
                raise ConcurrentRead(self)
            # The common wait, inlined: one coroutine less per output.
            table = self._table
            loop = table.loop
            # A task of the registry's loop, in that loop's thread, runs on it: no
            # asyncio.get_running_loop() (a getpid() system call per wait on 3.11).
            if loop is None or table.thread != _thread_id() or _current_task(loop) is None:
                loop = table.own_loop()  # (the full check: WrongLoop elsewhere)
            waiter = box.park(loop)
            if self._idle is not None:
                self._idle.deadline = None  # an untimed wait
            self._reading = True
            try:
                await waiter
            except asyncio.CancelledError:
                self._cancelled(box, waiter)
                raise
            finally:
                self._reading = False
            woken = True

    def ready(self) -> list[Any] | None:
        """Every output (or pair) that is ready now, oldest first, without waiting.

        The adapters' write loop polls with it, and waits with :meth:`wait_ready`
        only when nothing is ready: no coroutine per output.

        :returns: a non-empty list; ``[]`` when nothing is ready yet; ``None`` once
            everything finished and was read.
        :raises ProducerError: as for ``__anext__``.
        :raises Aborted: as for ``__anext__``.
        :raises WrongLoop: called from another thread with outputs ready (nothing is taken).
        """
        if self._reading:
            raise ConcurrentRead(self)
        box = self._box or self._first_read()
        if self._closed:
            return None
        # (the write loop polls this once per event with nothing there: no call for it)
        pending = box.pending
        if pending:
            # Taking from another thread would race the producer: refused before
            # anything is taken (only when there is something to take: an empty
            # poll costs nothing more).
            table = self._table
            if table.thread != _thread_id():
                table.check_thread("ready()")
        rest = self._take_buffered() if self._pos < len(self._buf) else None
        items = box.take() if pending else EMPTY
        if rest:
            rest.extend(items)
            return rest
        if items:
            return items
        if box.error is not None or not box.live:
            self._stop_idle()
            if box.error is not None:
                raise box.error.with_traceback(None)
            return None
        return []

    async def next_ready(self, *, timeout: float | None = None) -> list[Any] | None:
        """Every output (or pair) that is ready, oldest first, waiting for one if none is.

        :param timeout: give up waiting after this many seconds and return ``[]``.
        :returns: a non-empty list, ``[]`` when ``timeout`` passed with nothing
            ready, or ``None`` once everything finished and was read.
        :raises ProducerError: as for ``__anext__``.
        :raises Aborted: as for ``__anext__``.
        """
        items = self.ready()
        while items == []:
            await self.wait_ready(timeout=timeout)
            items = self.ready()
            if timeout is not None:
                break  # one timed wait: [] if it passed with nothing ready
        return items

    def set_sink(self, sink: Callable[[list[Any]], bool] | None) -> bool:
        """Let the producer hand this stream's outputs straight to ``sink``, inside its
        ``deliver()``, instead of waking the task that reads (``None`` removes it).

        For adapters that can write without waiting: while the reading task is parked
        in :meth:`wait_ready`, each ``deliver()`` calls ``sink(outputs)`` with what is
        ready, oldest first; the sink writes them and returns ``True``, or returns
        ``False`` (or raises) to decline: then the outputs stay readable, in order,
        the sink is removed and the reading task is woken. The end of the request,
        its error or its abort always wakes the reading task, never the sink; so does
        a sink that takes outputs and removes itself (it left the reader a write to
        finish), and the last output (``finished=True``), which the reader writes with
        the end. Remove the sink before the reading task writes by itself, so that
        bytes keep their order. A sink runs in the producer's step: it must be quick
        and never block; its exceptions never reach the producer (``CancelledError``
        included: raised by a sink, it is its send chain's, unless the producer's own
        task was cancelled during its step, whose cancellation then goes on). A sink
        that delivers to its own stream is not called again from inside itself: what
        it delivers waits behind the output it is offered, and once it answers, that
        output if it declined, then those, are folded in delivery order, one output
        at a time, as without a sink (a ``merge`` that raises fails the request, as
        in ``deliver()``); a last output (``finished=True``) delivered there ends the
        request only then. All of it counts against ``max_pending`` and the byte
        budget (over them, the request ends with :class:`~tether.ConsumerTooSlow`).
        A sink that aborts its own request leaves nothing to read, as any abort does;
        whatever a sink ends (its request, another stream, its scope, a batch),
        ``on_abort`` runs soon after the producer's step, never inside it.

        :returns: whether the sink is set; only a single request's stream that is
            live, with nothing ready, takes one (``False`` for a batch read whole).
        """
        box = self._box or self._first_read()
        if not isinstance(box, RequestState):
            return False
        if sink is None:
            box.set_sink(None)
            return False
        if (
            not box.live
            or box.error is not None
            or box.pending
            or self._closed
            or self._collecting
            or self._pos < len(self._buf)
        ):
            return False
        box.set_sink(sink)
        return True

    def _take_buffered(self) -> list[Any] | None:
        buf, pos = self._buf, self._pos
        if pos >= len(buf):
            return None
        self._buf = EMPTY
        self._pos = 0
        return buf[pos:] if pos else buf

    def _collect(self, outputs: list[Any], states: Sequence[RequestState]) -> None:
        """Enter collect mode for ``result()``: fold what was delivered but not read
        (``outputs``: ``(index, output)`` pairs) into each state's result, after which
        the producer folds and wakes the consumer only at the end; once (a second
        ``result()`` finds the results where the first left them)."""
        if self._collecting:
            return
        self._collecting = True
        if not outputs:  # (the usual wait: nothing was read before it)
            for state in states:
                state.collect(NOTHING)
            return
        table = self._table
        merge = table.limits.merge
        accs: list[Any] = [NOTHING] * len(states)
        failed: dict[int, Exception] = {}
        for index, output in outputs:
            if index not in failed:
                try:
                    accs[index] = fold(merge, accs[index], output)
                except Exception as exc:  # as in deliver(): that request fails alone
                    failed[index] = exc
        for state, acc in zip(states, accs, strict=True):
            state.collect(acc)
        for index, error in failed.items():
            table.merge_failed(states[index], error, False)

    def _uncollect(self, states: Sequence[RequestState]) -> None:
        """Leave collect mode early (cancelled): what was folded is readable again."""
        if self._collecting:
            self._collecting = False
            for state in states:
                state.uncollect()

    async def wait_ready(self, *, timeout: float | None = None) -> None:
        """Wait until :meth:`ready` has something to say (an output, the end, an
        error), or ``timeout`` seconds passed; at once if it has already.

        The one place a consumer parks: on a future made only now, which the
        producer's ``put`` (or the request's end) resolves. Cancellation of the
        waiting task is an abort of this consumer.
        """
        if self._reading:
            raise ConcurrentRead(self)
        box = self._box or self._first_read()
        if (
            not box.live
            or box.error is not None
            or self._closed
            or box.pending
            or self._pos < len(self._buf)  # (what an ``async for`` took but has not handed out)
        ):
            return
        waiter = self._waiter(box, timeout)
        self._reading = True  # (nobody else parks, or takes, until this wait ends)
        try:
            await waiter
        except asyncio.CancelledError:
            self._cancelled(box, waiter)
            raise
        finally:
            self._reading = False

    def _waiter(
        self,
        box: RequestState | Group,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> asyncio.Future[None]:
        """The future a wait of ``timeout`` seconds parks on (:meth:`wait_ready`'s and
        ``result()``'s, each awaited inline: no coroutine of its own); its deadline armed.
        ``loop``: the table's own loop, if the caller checked it already (:meth:`_result_loop`)."""
        if box.waiter is not None:  # (a waiter resolved or dropped is always cleared)
            raise ConcurrentRead(self)
        if loop is None:
            loop = self._table.own_loop()
        waiter = box.park(loop)
        idle = self._idle
        if idle is None and timeout is not None:
            idle = self._idle = IdleDeadline(functools.partial(_idle, weakref.ref(self)))
        if idle is not None:
            # One timer per consumer, re-armed only when needed: a stream that gets an
            # output every millisecond must not build and cancel a timer per output.
            idle.set(loop, timeout)
        return waiter

    def _result_loop(self) -> asyncio.AbstractEventLoop:
        """Refuse ``result()`` before it changes anything: another task reads, or this
        is another loop than the one the requests run on; else that loop."""
        if self._reading:
            raise ConcurrentRead(self)
        return self._table.own_loop()

    async def _collect_result(self, box: RequestState | Group, outputs: list[Any]) -> None:
        """``result()``'s wait: hold the consumer, collect the unread ``outputs``
        (``(index, output)`` pairs), wait until ``box`` ends or the consumer closes.
        Only this reader leaves collect mode, and only if cancelled (what was folded
        is then readable again)."""
        states = self._states
        self._reading = True
        waited = False
        try:
            self._collect(outputs, states)
            # In collect mode the producer folds and wakes nobody until the end, and
            # nothing else may read: each wake-up is the end, an error or a close.
            while box.live and box.error is None and not self._closed:
                waiter = self._waiter(box, None)
                try:
                    await waiter
                except asyncio.CancelledError:
                    self._cancelled(box, waiter)
                    raise
            waited = True
        finally:
            self._reading = False
            if not waited:
                self._uncollect(states)

    def _cancelled(self, box: RequestState | Group, waiter: asyncio.Future[None]) -> None:
        """The task waiting on ``waiter`` was cancelled: that is an abort of this consumer."""
        box.unpark(waiter)
        waiter_cancelled()
        self.cancel(AbortReason.CANCELLED)

    def _on_idle(self) -> None:
        """The timed wait's deadline passed: it ends with nothing ready."""
        if self._box is not None:
            self._box.wake()

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.clear()
