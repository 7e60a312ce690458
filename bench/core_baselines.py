"""Hand-written request tables that ``core.py`` measures tether against.

Each baseline is what a server team writes without tether, reduced to the hot
path: open a request, route outputs to it, read them, free it when finished.

* :class:`EventTable` (a): a table of states, each with an ``asyncio.Event`` and
  an output list; the reader is an async generator that waits with
  ``asyncio.wait_for(event.wait(), timeout)``, the common LLM-server pattern.
* :class:`SlotTable` (b): a single-slot collector per request that merges
  outputs when the reader is behind, woken by an ``asyncio.Event``.
* :class:`QueueTable` (c): one ``asyncio.Queue`` per request.
* :class:`FloorTable` (d): not a pattern servers write but the least any table with
  tether's reading API can do: a dict of slots, a future made only when a reader
  waits, a reader class whose ``__anext__`` is a coroutine (what ``async for`` over
  a class costs), and nothing else: no bounds, no thread or loop checks, no ends
  other than the last output. What tether's guarantees cost is tether against it.

All four capture the state when the reader is built (the table entry may be
freed by the finishing output before the reader first runs), so that they
complete the same workload tether does. Given a ``merge`` (the with-merge
workload), (a) folds an output into the newest one waiting and (b) folds into
its slot, as tether's registry does with its ``merge``, so that a reader that
is behind reads one merged output; a queue (c) has nothing to fold into.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

__all__ = ["EventTable", "FloorTable", "QueueTable", "SlotTable"]

_WAIT_TIMEOUT: Final = 4.0  # the waiter's "is the client still there?" poll interval
_DONE: Final = object()
_EMPTY: Final = object()

Merge = Callable[[Any, Any], Any]


class _EventState:
    __slots__ = ("event", "finished", "outputs")

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.finished = False
        self.event = asyncio.Event()


class EventTable:
    """(a) ``rid -> state(Event, outputs)``; readers poll with ``wait_for``."""

    def __init__(self, merge: Merge | None = None) -> None:
        self._table: dict[str, _EventState] = {}
        self._ids = itertools.count()
        self._merge = merge

    def open(self) -> tuple[str, AsyncIterator[Any]]:
        rid = str(next(self._ids))
        state = self._table[rid] = _EventState()
        return rid, self._read(state)

    async def _read(self, state: _EventState) -> AsyncIterator[Any]:
        while True:
            try:
                await asyncio.wait_for(state.event.wait(), _WAIT_TIMEOUT)
            except TimeoutError:
                continue  # here a server checks whether the client left
            outputs, state.outputs = state.outputs, []
            state.event.clear()
            for output in outputs:
                yield output
            if state.finished:
                return

    def deliver(self, rid: str, output: Any, finished: bool) -> None:
        state = self._table.get(rid)
        if state is None:
            return
        outputs = state.outputs
        if self._merge is not None and outputs:
            outputs[-1] = self._merge(outputs[-1], output)
        else:
            outputs.append(output)
        if finished:
            state.finished = True
            del self._table[rid]
        state.event.set()


class _Slot:
    __slots__ = ("finished", "output", "ready")

    def __init__(self) -> None:
        self.output: Any = None
        self.finished = False
        self.ready = asyncio.Event()


class SlotTable:
    """(b) one slot per request; a reader that is behind gets the merged outputs
    (a list of them, or with ``merge`` the one they fold into)."""

    def __init__(self, merge: Merge | None = None) -> None:
        self._table: dict[str, _Slot] = {}
        self._ids = itertools.count()
        self._merge = merge

    def open(self) -> tuple[str, AsyncIterator[Any]]:
        rid = str(next(self._ids))
        slot = self._table[rid] = _Slot()
        if self._merge is not None:
            slot.output = _EMPTY
            return rid, self._read(slot, _EMPTY, unpack=False)
        return rid, self._read(slot, None, unpack=True)

    async def _read(self, slot: _Slot, empty: Any, *, unpack: bool) -> AsyncIterator[Any]:
        while True:
            output = slot.output
            if output is empty:
                if slot.finished:
                    return
                await slot.ready.wait()
                continue
            slot.output = empty
            slot.ready.clear()
            if not unpack:
                yield output  # the one they were merged into
                continue
            for item in output:  # the merged outputs, oldest first
                yield item

    def deliver(self, rid: str, output: Any, finished: bool) -> None:
        slot = self._table.get(rid)
        if slot is None:
            return
        merge = self._merge
        if merge is not None:
            slot.output = output if slot.output is _EMPTY else merge(slot.output, output)
        elif slot.output is None:
            slot.output = [output]
        else:
            slot.output.append(output)  # merge: the reader is behind
        if finished:
            slot.finished = True
            del self._table[rid]
        slot.ready.set()


class QueueTable:
    """(c) one ``asyncio.Queue`` per request, ended by a sentinel."""

    def __init__(self, merge: Merge | None = None) -> None:  # (nothing to fold into)
        self._table: dict[str, asyncio.Queue[Any]] = {}
        self._ids = itertools.count()

    def open(self) -> tuple[str, AsyncIterator[Any]]:
        rid = str(next(self._ids))
        queue = self._table[rid] = asyncio.Queue()
        return rid, self._read(queue)

    async def _read(self, queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
        while True:
            output = await queue.get()
            if output is _DONE:
                return
            yield output

    def deliver(self, rid: str, output: Any, finished: bool) -> None:
        queue = self._table.get(rid)
        if queue is None:
            return
        queue.put_nowait(output)
        if finished:
            queue.put_nowait(_DONE)
            del self._table[rid]


class _Floor:
    __slots__ = ("finished", "items", "waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiter: asyncio.Future[None] | None = None
        self.finished = False


class _FloorReader:
    __slots__ = ("_buf", "_pos", "_slot")

    def __init__(self, slot: _Floor) -> None:
        self._slot = slot
        self._buf: list[Any] = []
        self._pos = 0

    def __aiter__(self) -> _FloorReader:
        return self

    async def __anext__(self) -> Any:
        buf, pos = self._buf, self._pos
        if pos < len(buf):  # (the rest of what one wake-up found)
            self._pos = pos + 1
            return buf[pos]
        slot = self._slot
        while True:
            items = slot.items
            if items:
                slot.items = []
                if len(items) > 1:
                    self._buf, self._pos = items, 1
                return items[0]
            if slot.finished:
                raise StopAsyncIteration
            slot.waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter


class FloorTable:
    """(d) the floor: ``rid -> slot``, the reader woken through one future per wait."""

    def __init__(self, merge: Merge | None = None) -> None:
        self._table: dict[str, _Floor] = {}
        self._ids = itertools.count()
        self._merge = merge

    def open(self) -> tuple[str, AsyncIterator[Any]]:
        rid = str(next(self._ids))
        slot = self._table[rid] = _Floor()
        return rid, _FloorReader(slot)

    def deliver(self, rid: str, output: Any, finished: bool) -> None:
        slot = self._table.get(rid)
        if slot is None:
            return
        items = slot.items
        if self._merge is not None and items:
            items[-1] = self._merge(items[-1], output)
        else:
            items.append(output)
        if finished:
            slot.finished = True
            del self._table[rid]
        waiter = slot.waiter
        if waiter is not None:
            slot.waiter = None
            try:  # (a reader cancelled while it waited left its future cancelled)
                waiter.set_result(None)
            except asyncio.InvalidStateError:
                pass
