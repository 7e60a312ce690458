"""Calls made on other threads, run on the registry's loop in the order they were made.

A producer thread's ``deliver_many_threadsafe`` (and the other ``*_threadsafe``
calls) cross to the loop with ``call_soon_threadsafe`` and run there in a loop
callback, which has no task. A write driven from the producer's step
(:class:`~tether.http.Stepped`, an ASGI ``send``) needs one, since a ``send`` chain
may (``asyncio.timeout``, anyio): outside a task it is declined, and the output
wakes its handler's task to be written there. An engine thread's step over 512
requests then wakes 512 tasks.

So the first such decline (:func:`want_task`) turns a :class:`HandOver` to running
its calls in a task, one per burst of hand-overs: the first call of a burst starts
it, later ones queue behind it, and it runs everything queued, in order, then ends.
It never awaits, so it runs in one step and ends there: a ``send`` wrapper's timer
that fires later cancels a task that is already done. A burst cancelled before its
step (by whoever cancels every task) leaves its calls to the next burst, which runs
them first; only the loop's own shutdown, with no call after it, drops them, with
the requests they were for. A registry whose writers need no task (aiohttp's write
to the transport) never pays for one.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["HandOver", "want_task"]

Call = tuple[Callable[..., object], tuple[Any, ...]]

_running: contextvars.ContextVar[HandOver | None] = contextvars.ContextVar(
    "tether_handover", default=None
)


def want_task() -> bool:
    """Called by a write declined for want of a task: if a hand-over from a thread is
    running (in a loop callback), its next calls run in a task; whether one was."""
    hand = _running.get()
    if hand is None:
        return False
    hand.in_task = True
    return True


class HandOver:
    """The ordered queue of calls handed to one loop from other threads.

    ``in_task``: whether they run in a task (set by :func:`want_task`, for good).
    """

    __slots__ = ("_calls", "_task", "in_task")

    def __init__(self) -> None:
        self._calls: deque[Call] = deque()
        self._task: asyncio.Task[None] | None = None
        self.in_task = False

    def send(
        self, loop: asyncio.AbstractEventLoop, call: Callable[..., object], *args: Any
    ) -> None:
        """Run ``call(*args)`` on ``loop``, after every call sent before it (any thread).

        :raises RuntimeError: the loop is closed.
        """
        loop.call_soon_threadsafe(self._arrive, loop, (call, args))

    def _arrive(self, loop: asyncio.AbstractEventLoop, call: Call) -> None:
        self._calls.append(call)
        running = self._task
        if running is not None and not running.done() and not running.cancelling():
            return  # queued behind the burst that is about to run
        # (a burst cancelled before its step never runs: the calls it left run in
        # this one, first)
        if not self.in_task:
            self._task = None
            token = _running.set(self)
            try:
                self._drain(loop)
            finally:
                _running.reset(token)
            return
        task = loop.create_task(self._run(), name="tether-handover")
        self._task = None if task.done() else task  # (an eager task factory ran it at once)

    async def _run(self) -> None:
        self._drain(asyncio.get_running_loop())
        self._task = None  # (the next call starts a new burst)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        calls = self._calls
        while calls:
            call, args = calls.popleft()
            try:
                call(*args)
            except Exception as exc:  # as a loop callback's is: reported, and on
                loop.call_exception_handler(
                    {
                        "message": f"Exception in {call!r}, handed over from a thread",
                        "exception": exc,
                    }
                )
