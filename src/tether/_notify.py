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
    """Whether a producer's call (``deliver``, ``deliver_many``, ``fail``, ``fail_all``)
    is under way on one loop, whichever of that loop's registries it went to: an
    engine that serves several registries is in the middle of its step for all of
    them. A depth, not a flag: each call adds one and takes it back when it returns
    or raises, so calls that nest, or (misuse) overlap from another thread at call
    boundaries, leave it at 0 once all have returned."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0


_STEPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Steps] = weakref.WeakKeyDictionary()


def steps_of(loop: asyncio.AbstractEventLoop) -> Steps:
    """The :class:`Steps` of ``loop``, shared by every registry on it."""
    steps = _STEPS.get(loop)
    if steps is None:
        steps = _STEPS.setdefault(loop, Steps())
    return steps


class Notifier:
    """Calls ``on_abort`` for the table; its exceptions are logged, never raised.

    :param on_abort: the registry's callback, or ``None``.
    :param abort_timeout: bound, in seconds, on an asynchronous ``on_abort``.
    """

    __slots__ = ("_due", "_held", "_on_abort", "_queue", "_tasks", "_telling", "_timeout")

    def __init__(self, on_abort: OnAbort | None, abort_timeout: float) -> None:
        self._on_abort = on_abort
        self._timeout = abort_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: set[str] = set()
        self._queue: collections.deque[str] = collections.deque()  # (to tell, in order)
        self._telling = False  # (a call of on_abort is under way: the rest wait for it)
        self._due = False  # (a call on the loop will tell the queue)

    def holds(self, rid: str) -> bool:
        """Whether ``rid`` was freed but its producer has not taken the abort in yet."""
        return rid in self._held

    def tell(self, rids: list[str], loop: asyncio.AbstractEventLoop | None) -> None:
        """Call ``on_abort`` for each of ``rids``, after those already waiting: soon on
        ``loop`` (each rid held until then), or now when ``loop`` is ``None`` (inside
        an ``on_abort``: as soon as it returns)."""
        if self._on_abort is None or not rids:
            return
        self._held.update(rids)
        self._queue.extend(rids)
        if loop is not None:
            if not self._due:
                self._due = True
                loop.call_soon(self._soon)
        elif not self._telling:
            self._tell_all()

    def _soon(self) -> None:
        self._due = False
        if not self._telling:
            self._tell_all()

    def _tell_all(self) -> None:
        """Tell the queue, oldest first, until it is empty (what an ``on_abort`` ends
        joins it, and is told in turn: a chain of any length, never nested)."""
        queue = self._queue
        self._telling = True
        try:
            while queue:
                self._call(queue.popleft())
        except BaseException:  # (KeyboardInterrupt in on_abort: the rest still told, soon)
            if queue and not self._due:
                try:
                    asyncio.get_running_loop().call_soon(self._soon)
                    self._due = True
                except RuntimeError:
                    pass  # (no loop: the next tell, or close(), tells them)
            raise
        finally:
            self._telling = False

    def _call(self, rid: str) -> None:
        callback = self._on_abort
        try:
            result = None if callback is None else callback(rid)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)
            result = None
        except BaseException:  # (it goes on: the rid is not held for ever)
            self._held.discard(rid)
            raise
        if inspect.isawaitable(result):
            self._held.add(rid)  # until the producer has taken the abort in
            task = asyncio.get_running_loop().create_task(self._await(rid, result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._held.discard(rid)

    async def _await(self, rid: str, awaitable: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await awaitable
        except TimeoutError:
            logger.error("on_abort(%r) took longer than %gs; abandoned", rid, self._timeout)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)
        finally:
            self._held.discard(rid)

    async def wait(self) -> None:
        """Tell what waits to be told, then wait (bounded by ``abort_timeout``) for the
        asynchronous calls under way (the registry closes: no producer's step is)."""
        if self._queue and not self._telling:
            self._tell_all()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout)
