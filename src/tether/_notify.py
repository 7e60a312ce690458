"""Telling the producer: ``on_abort(rid)``, once per request closed before it finished.

A :class:`Notifier` calls the registry's ``on_abort`` now, or soon (``defer``: when
the table was entered from the producer's own call, so that the callback never
re-enters the producer in the middle of its step), and runs an asynchronous one as
a task it owns and bounds. Until the producer has taken an abort in, the rid stays
*held*: a producer that has not heard of the abort would still route the old
work's outputs to whoever opened that rid next, so the table refuses to reopen it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable

from .types import OnAbort

__all__ = ["Notifier"]

logger = logging.getLogger("tether")


class Notifier:
    """Calls ``on_abort`` for the table; its exceptions are logged, never raised.

    :param on_abort: the registry's callback, or ``None``.
    :param abort_timeout: bound, in seconds, on an asynchronous ``on_abort``.
    """

    __slots__ = ("_held", "_on_abort", "_tasks", "_timeout")

    def __init__(self, on_abort: OnAbort | None, abort_timeout: float) -> None:
        self._on_abort = on_abort
        self._timeout = abort_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._held: set[str] = set()

    def holds(self, rid: str) -> bool:
        """Whether ``rid`` was freed but its producer has not taken the abort in yet."""
        return rid in self._held

    def tell(self, rids: list[str], loop: asyncio.AbstractEventLoop | None) -> None:
        """Call ``on_abort`` for each of ``rids``: soon on ``loop`` (each rid held until
        then), or now when ``loop`` is ``None``."""
        if self._on_abort is None or not rids:
            return
        for rid in rids:
            if loop is not None:
                self._held.add(rid)
                loop.call_soon(self._call, rid)
            else:
                self._call(rid)

    def _call(self, rid: str) -> None:
        callback = self._on_abort
        try:
            result = None if callback is None else callback(rid)
        except Exception:
            logger.exception("on_abort(%r) raised; the request was freed anyway", rid)
            result = None
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
        """Wait (bounded by ``abort_timeout``) for the asynchronous calls under way."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._timeout)
