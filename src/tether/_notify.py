"""Telling the producer: ``on_abort(rid)``, once per request closed before it finished.

A :class:`Notifier` calls the registry's ``on_abort`` now, or soon (``defer``: while
a producer's call is under way on the loop, see :class:`Steps`, so that the callback
never re-enters the producer in the middle of its step), and runs an asynchronous
one as a task it owns and bounds. Every call goes through one queue, in the order
the requests ended: a call told now first tells those still waiting to be told soon,
and an ``on_abort`` that ends more requests has theirs told after it returns, one
after the other, never nested. Until the producer has taken an abort in, the rid
stays *held*: a producer that has not heard of the abort would still route the old
work's outputs to whoever opened that rid next, so the table refuses to reopen it.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import weakref
from collections.abc import Awaitable

from .types import OnAbort

__all__ = ["Notifier", "Steps", "steps_of"]

logger = logging.getLogger("tether")


class Steps:
    """One loop's producer: whether one of its calls (``deliver``, ``deliver_many``,
    ``fail``, ``fail_all``) is under way, to any of the loop's registries, and the
    ``on_abort`` calls waiting to be told, theirs all together: an engine that serves
    several registries is in the middle of its step for all of them, and hears of
    their aborts in the order the requests ended, one at a time.

    ``depth`` is a count, not a flag: each call adds one and takes it back when it
    returns or raises, so calls that nest, or (misuse) overlap from another thread at
    call boundaries, leave it at 0 once all have returned."""

    __slots__ = ("_due_on", "_loop", "_queue", "_telling", "depth")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = None if loop is None else weakref.ref(loop)  # (whose steps these are)
        self.depth = 0
        self._queue: collections.deque[tuple[Notifier, str]] = collections.deque()
        self._telling = False  # (an on_abort is under way: the rest wait for it)
        self._due_on: asyncio.AbstractEventLoop | None = None  # (a call there tells)

    def tell(
        self, notifier: Notifier, rids: list[str], loop: asyncio.AbstractEventLoop | None
    ) -> None:
        """Queue ``notifier``'s ``on_abort`` for each of ``rids``, after every call
        waiting: told soon on ``loop``, or now when ``loop`` is ``None`` (from inside
        an ``on_abort``: as soon as it returns)."""
        self._queue.extend((notifier, rid) for rid in rids)
        if loop is not None and loop.is_closed():
            loop = None  # (a producer's call after its loop closed: nothing can defer it)
        if loop is None:
            self.flush()
        elif self._due_on is not loop:  # (a call due on a loop that stopped never runs)
            self._due(loop)

    def _due(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due_on = loop
        loop.call_soon(self._soon)

    def _soon(self) -> None:
        self._due_on = None
        self.flush()

    def tell_all(self) -> None:
        """Tell the queue, oldest first, until it is empty (what an ``on_abort`` ends
        joins it, and is told in turn: a chain of any length, never nested)."""
        queue = self._queue
        self._telling = True
        try:
            while queue:
                notifier, rid = queue.popleft()
                notifier.call(rid, self)
        except BaseException:  # (KeyboardInterrupt in on_abort: the rest still told, soon)
            if queue:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    pass  # (no loop: the next tell, or close(), tells them)
                else:
                    self._due(loop)
            raise
        finally:
            self._telling = False

    def flush(self) -> None:
        """Tell the queue now, unless an ``on_abort`` is under way (it will)."""
        if not self._telling:
            self.tell_all()

    def take(self, notifier: Notifier) -> list[str]:
        """The rids of ``notifier`` still to be told, taken out of the queue (its
        registry moved to another loop: this one will not tell them)."""
        queue = self._queue  # (in place: a telling under way holds this very queue)
        taken = [rid for owner, rid in queue if owner is notifier]
        if taken:
            kept = [entry for entry in queue if entry[0] is not notifier]
            queue.clear()
            queue.extend(kept)
        return taken

    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop these steps are of, while it is open (``None`` before a loop)."""
        loop = None if self._loop is None else self._loop()
        return None if loop is None or loop.is_closed() else loop


_STEPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Steps] = weakref.WeakKeyDictionary()


def steps_of(loop: asyncio.AbstractEventLoop) -> Steps:
    """The :class:`Steps` of ``loop``, shared by every registry on it."""
    steps = _STEPS.get(loop)
    if steps is None:
        steps = _STEPS.setdefault(loop, Steps(loop))
    return steps


class Notifier:
    """Calls ``on_abort`` for the table; its exceptions are logged, never raised.

    :param on_abort: the registry's callback, or ``None``.
    :param abort_timeout: bound, in seconds, on an asynchronous ``on_abort``.
    """

    __slots__ = ("_held", "_on_abort", "_tasks", "_timeout")

    def __init__(self, on_abort: OnAbort | None, abort_timeout: float) -> None:
        self._on_abort = on_abort
        self._timeout = abort_timeout
        # (each call's rid and what it awaits: a task's name is its code's to change)
        self._tasks: dict[asyncio.Task[None], tuple[str, Awaitable[object]]] = {}
        self._held: set[str] = set()

    def holds(self, rid: str) -> bool:
        """Whether ``rid`` was freed but its producer has not taken the abort in yet (a
        call of it left on a loop since closed never will: it is let go)."""
        if rid not in self._held:
            return False
        for task, (owner, _) in list(self._tasks.items()):
            if owner == rid and task.get_loop().is_closed():
                task.remove_done_callback(self._let_go)
                task.get_coro().close()  # (never to run: its loop is gone)
                self._let_go(task)
        return rid in self._held

    def tell(self, steps: Steps, rids: list[str], loop: asyncio.AbstractEventLoop | None) -> None:
        """Call ``on_abort`` for each of ``rids`` through ``steps``' queue (see
        :meth:`Steps.tell`); each rid is held until it was told."""
        if self._on_abort is None or not rids:
            return
        self._held.update(rids)
        steps.tell(self, rids, loop)

    def moved(self, old: Steps, new: Steps, loop: asyncio.AbstractEventLoop) -> None:
        """The registry moved to ``loop``: what the old loop had still to tell is told
        soon on this one (that loop stopped: it will not). Calls running on the old
        loop go on there (it may run again); one whose loop closed is let go when its
        rid is asked for (:meth:`holds`)."""
        rids = old.take(self)
        if rids:
            new.tell(self, rids, loop)

    def call(self, rid: str, steps: Steps) -> None:
        """Call ``on_abort(rid)`` now (an asynchronous one starts as a task, on the
        running loop or else on ``steps``' own loop, run or not)."""
        callback = self._on_abort
        try:
            result = None if callback is None else callback(rid)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)
            result = None
        except BaseException:  # (it goes on: the rid is not held for ever)
            self._held.discard(rid)
            raise
        if not inspect.isawaitable(result):
            self._held.discard(rid)
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = steps.loop()  # (between two runs of its loop: it runs there next)
        if loop is None:  # (told with no loop to run it: nothing can)
            self._held.discard(rid)
            close = getattr(result, "close", None)
            if close is not None:
                close()
            logger.error("on_abort(%r) is asynchronous and no loop runs: not awaited", rid)
            return
        task = loop.create_task(self._await(rid, result), name=f"on_abort({rid!r})")
        self._tasks[task] = (rid, result)
        task.add_done_callback(self._let_go)

    def _let_go(self, task: asyncio.Task[None]) -> None:
        """An asynchronous ``on_abort`` is over, however (cancelled before it began,
        too, or its loop gone: its rid is not held for ever)."""
        call = self._tasks.pop(task, None)
        if call is None:
            return
        rid, awaitable = call
        self._held.discard(rid)
        close = getattr(awaitable, "close", None)
        if close is not None:  # (one that never ran is closed, not left unawaited)
            close()

    async def _await(self, rid: str, awaitable: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await awaitable
        except TimeoutError:
            logger.error("on_abort(%r) took longer than %gs; abandoned", rid, self._timeout)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)

    async def wait(self, steps: Steps) -> None:
        """Tell what waits to be told, then wait (bounded by ``abort_timeout``) for the
        asynchronous calls under way on this loop (the registry closes: no producer's
        step is)."""
        steps.flush()
        loop = asyncio.get_running_loop()
        tasks = {task for task in self._tasks if task.get_loop() is loop}
        if tasks:
            await asyncio.wait(tasks, timeout=self._timeout)
