"""Stepped: a framework's awaitable write driven outside its task, one step at a time.

An ASGI server's ``send`` returns an awaitable that, while the transport has room,
completes without ever suspending (uvicorn writes to its transport at once). Driven
one step from the producer's ``deliver()`` it writes there and then, in order, and no
task of the handler's is woken for the event. When the step suspends instead (the
server's flow control, a middleware that awaits), the write has *begun*: the
suspended awaitable goes to the handler's write loop, which finishes it before it
writes anything else (:class:`_Begun` yields on to the task what the step yielded).
A step that raises hands the error to the write loop the same way: it never reaches
the producer.

Departure, on purpose: every step of a write it drives runs in a copy of the handler
task's context, taken when the writer is made, so that a middleware wrapping ``send``
reads the request's context variables (a tracing span) as in the handler's own task,
and resets what it set in the context it set it in. What no copy can give is the task:
a ``send`` wrapper that binds itself to ``asyncio.current_task()`` (``asyncio.timeout``
around the inner ``send``, an anyio cancel scope) would bind to the producer's.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Final

__all__ = ["Stepped"]

logger = logging.getLogger("tether")

_thread_id = threading.get_ident
_current_task = asyncio.current_task

SUSPENDS_IN_A_ROW: Final = 4
"""Writes in a row whose first step suspended (a checkpoint somewhere in the chain:
anyio's memory streams behind ``BaseHTTPMiddleware``, say): from then on the writer
declines, and the handler's task writes as it would without one."""


class Stepped:
    """A :class:`~tether.http.Direct` made of a framework's own write (``write(chunk,
    last)`` returning an awaitable, an ASGI ``send``): each write is driven one step
    now, in the context of the task that made this (the handler's).

    ``write`` returns ``True`` (written: the step completed), ``False`` (not tried: the
    writer is busy or its writes keep suspending), or the begun write: an awaitable
    that the writing task must await before anything else is written, or ``close()``
    if the response is cut.

    :param callbacks: write in a loop callback of the handler's thread too (a producer
        thread's hand-over runs there), where no task is current: only for a ``send``
        chain that needs none (a wrapper that does, such as ``asyncio.timeout``, raises
        there, and that response fails). Off: such a hand-over settles it (below).
    """

    __slots__ = ("_busy", "_context", "_loop", "_suspended", "_tasks_only", "_thread", "_write")

    def __init__(
        self, write: Callable[[bytes, bool], Awaitable[object]], *, callbacks: bool = False
    ) -> None:
        self._write, self._tasks_only = write, not callbacks
        self._thread = threading.get_ident()
        # (current_task() with the loop named: without it, a getpid() per write on 3.11)
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._busy = False  # (a write's step re-entering write(): the context is entered)
        self._suspended = 0

    def writable(self) -> bool:
        """Whether a write is worth trying now: its writes do not keep suspending, and
        this is a task of the handler's thread (with ``callbacks``, any code of it). A
        write from elsewhere (another thread; without ``callbacks``, a producer thread's
        hand-over in a loop callback) settles it: the handler writes for good, at once
        (its own writes through this would otherwise reset the count, and every output
        would be offered, declined and written by the handler, at a fifth more CPU)."""
        if self._suspended >= SUSPENDS_IN_A_ROW or self._busy:
            return False
        if _thread_id() != self._thread or (self._tasks_only and _current_task(self._loop) is None):
            self._suspended = SUSPENDS_IN_A_ROW
            return False
        return True

    def write(self, chunk: bytes) -> bool | _Begun:
        """Drive the write of ``chunk`` one step: ``True`` if that wrote it, ``False`` if
        it was not tried, else the begun write (to await, or ``close()``)."""
        # Only from a task of the handler's thread (writable()) unless told otherwise: a
        # thread's hand-over runs in a loop callback, where a send chain that needs a
        # task (anyio, asyncio.timeout) raises; a deliver() from elsewhere never writes.
        # (writable()'s tests inline: its call only when one fails, to settle it)
        if (
            self._suspended >= SUSPENDS_IN_A_ROW
            or self._busy
            or _thread_id() != self._thread
            or (self._tasks_only and _current_task(self._loop) is None)
        ) and not self.writable():
            return False
        return self.write_checked(chunk)

    def write_checked(self, chunk: bytes) -> bool | _Begun:
        """:meth:`write`, when :meth:`writable` said ``True`` just now, in this same
        synchronous step (the producer's write of each event asks it before encoding):
        not asked again."""
        steps = self._write(chunk, False).__await__()
        self._busy = True
        try:
            yielded = self._context.run(steps.send, None)
        except StopIteration:
            self._suspended = 0
            return True
        except (Exception, asyncio.CancelledError) as exc:
            # The writing task meets it, as in its own write; a CancelledError too: it
            # is the send chain's (a cancelled future awaited in its step), never the
            # producer's, whose cancellation cannot be delivered inside this
            # synchronous call (cancel() on the running task marks its next await).
            if isinstance(exc, RuntimeError) and _current_task(self._loop) is None:
                _say_taskless(exc)
            return _Begun(None, exc, self._context)
        finally:
            self._busy = False
        self._suspended += 1
        return _Begun(steps, yielded, self._context)


_said = False  # (whether _say_taskless() said it at WARNING in this process)


def _say_taskless(exc: RuntimeError) -> None:
    """Tell the operator, once per process, the likely cause of a send that raised
    ``RuntimeError`` outside any task (``callbacks``: ``producer_writes="threads"``)."""
    global _said
    level = logging.DEBUG if _said else logging.WARNING
    _said = True
    logger.log(
        level,
        "a send raised %r outside any task (a producer thread's hand-over, written in its "
        "loop callback); its response fails. If a send wrapper needs a task "
        "(asyncio.timeout, anyio), producer_writes='threads' cannot be used with it",
        exc,
    )


class _Begun:
    """A write whose first step ran elsewhere: awaiting it yields on what that step
    yielded (the future it waits for) and drives the rest from the awaiting task, in
    the same context as the first (a middleware that set a context variable around
    its ``send`` resets it there); or re-raises what the step raised."""

    __slots__ = ("_context", "_steps", "_yielded")

    def __init__(
        self, steps: Generator[Any, None, object] | None, yielded: Any, context: contextvars.Context
    ) -> None:
        self._steps = steps
        self._yielded = yielded
        self._context = context

    def __await__(self) -> Generator[Any, Any, object]:
        steps, yielded, run = self._steps, self._yielded, self._context.run
        self._yielded = None
        if steps is None:
            raise yielded
        while True:
            try:
                sent = yield yielded
            except BaseException as exc:  # thrown in (a cancellation): on to the write
                try:
                    yielded = run(steps.throw, exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = run(steps.send, sent)
                except StopIteration as stop:
                    return stop.value

    def close(self) -> None:
        """Abandon the write (nothing more of it is written): cancelled first, as a
        task's cut write is, so that the send chain gives back what it holds (a
        semaphore's permit, a lock), then closed."""
        self._yielded = None
        steps, self._steps = self._steps, None
        if steps is None:
            return
        try:
            self._context.run(steps.throw, asyncio.CancelledError())
        except BaseException:  # (the cancellation, or whatever the chain made of it)
            pass
        self._context.run(steps.close)
