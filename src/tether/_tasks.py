"""Stopping the tasks one owns: cancel, then wait for them to end.

Every background task (a receive watcher, a socket reader, an engine loop) has an
owner that cancels and awaits it. Awaiting a task cancelled just now raises its
``CancelledError`` in the owner; that one is consumed, while a cancellation of the
owner itself (``current_task().cancelling()``) goes on. A watch that needs no task
of its own can be :class:`Driven` instead, and closed at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

__all__ = ["Driven", "read_ahead", "stop_tasks"]

logger = logging.getLogger("tether")


class Driven:
    """Runs a coroutine as a task would, without a Task: for a watch whose awaits are
    plain futures and that nothing inside needs a task for (no ``asyncio.timeout``, no
    ``current_task()``), it saves the Task, its cancel and the loop turn to await its end.

    It starts at the loop's next turn; :meth:`close` ends it at once, where it waits
    (``GeneratorExit``: its ``finally`` blocks run, the future it waited on is forgotten).
    An exception it lets out is logged, as a task's would be.
    """

    __slots__ = ("_context", "_coro", "_loop", "_waited")

    def __init__(self, coro: Coroutine[Any, Any, None]) -> None:
        self._coro: Coroutine[Any, Any, None] | None = coro
        self._context = contextvars.copy_context()  # one for every step, as a task's
        # (asked once: on 3.11 each get_running_loop() is a getpid() system call)
        self._loop = loop = asyncio.get_running_loop()
        self._waited: asyncio.Future[Any] | None = None  # the future it waits on now
        loop.call_soon(self._step, context=self._context)

    def _step(self, _: object = None, *, thrown: BaseException | None = None) -> None:
        coro = self._coro  # (also the done callback of its wait)
        if coro is None:  # closed
            return
        self._waited = None
        try:
            waited = coro.send(None) if thrown is None else coro.throw(thrown)
        except (StopIteration, asyncio.CancelledError):  # ended; or what it waited on, cut
            self._coro = None
            return
        except Exception:
            self._coro = None
            logger.exception("a coroutine run without a task failed")
            return
        loop, context = self._loop, self._context
        if asyncio.isfuture(waited):
            self._waited = waited
            waited.add_done_callback(self._step, context=context)
        elif waited is None:  # a bare yield (sleep(0)): on at the next turn
            loop.call_soon(self._step, context=context)
        else:  # as a task does: the coroutine meets the error where it waits
            bad = RuntimeError(f"a coroutine run without a task awaited {waited!r}, not a future")
            loop.call_soon(functools.partial(self._step, thrown=bad), context=context)

    def close(self) -> None:
        """End it now (idempotent). Called from inside it, it is never stepped again."""
        coro, self._coro = self._coro, None
        waited, self._waited = self._waited, None
        if waited is not None:  # (its wait may cancel that future: no step to schedule)
            waited.remove_done_callback(self._step)
        if coro is not None and not getattr(coro, "cr_running", False):
            coro.close()


def read_ahead(coro: Coroutine[Any, Any, None], receive: object) -> asyncio.Task[None] | Driven:
    """Run ``coro``, which reads an ASGI ``receive`` ahead of the app to see a disconnect:
    :class:`Driven` when ``receive`` is the server's own (uvicorn's request cycle, the
    ``asyncio.Queue.get`` of hypercorn), which waits on plain futures; else as a task,
    since a middleware's wrapper may need one (``asyncio.timeout``, an anyio cancel
    scope, ``BaseHTTPMiddleware``) or reset a context (OpenTelemetry's). Either is
    ended by :func:`stop_tasks`."""
    owner = getattr(receive, "__self__", None)
    own = getattr(receive, "__func__", None) is asyncio.Queue.get
    if own or type(owner).__module__.startswith("uvicorn.protocols.http."):
        return Driven(coro)
    return asyncio.get_running_loop().create_task(coro, name="tether-rx")


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | asyncio.Future[Any] | Driven]) -> None:
    """Cancel ``tasks`` and wait until each has ended (a :class:`Driven` one is closed at
    once). Their own cancellation is not raised; a cancellation of the caller is; so is
    any other exception of theirs."""
    tasks = list(tasks)
    for task in tasks:
        if not isinstance(task, Driven):
            task.cancel()
    for task in tasks:  # (every task is cancelled before anything of theirs is raised)
        if isinstance(task, Driven):
            task.close()
            continue
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
