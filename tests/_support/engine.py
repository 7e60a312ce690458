"""The one fake engine of the suite: each request it is given plays a script through
the registry, in a task the engine owns, as an inference engine's step would.

A script is any iterable of steps: an output (the last one finishes the request,
unless a :data:`HANG` follows), an :class:`asyncio.Event` to wait for, a
:class:`Pause` (the engine's own pace), a callable to call (a signal to the test,
given in the engine's step), an exception to fail the request with, or a
:data:`HANG` (the request stays open until something else ends it). A script
stops early once the registry refuses an output (the request is gone). ``abort``
(the registry's ``on_abort``) drops the request's job at once, as engines do: they
know requests only by their id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import tether

BOUND: Final = 10.0
"""A generous bound on every wait for a change."""

HANG: Final = object()
"""A script's last step that leaves its request open until it is aborted."""

_END: Final = object()


@dataclasses.dataclass(frozen=True)
class Pause:
    """A script step: the engine's pace between two outputs (not a synchronisation)."""

    seconds: float = 0.0


class Changes:
    """Lets a test wait for a condition that callbacks make true, without polling."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def signal(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(BOUND):
            while not predicate():
                await self._event.wait()


class Engine(Changes):
    """Plays :attr:`script` for every request submitted (``script = None``: nothing,
    the test delivers by hand). It makes its own registry (``options`` go to it) unless
    given one, whose ``on_abort`` is then the caller's to wire to :meth:`abort`."""

    def __init__(self, registry: tether.Registry | None = None, **options: Any) -> None:
        super().__init__()
        self.registry = registry if registry is not None else tether.Registry(self.abort, **options)
        self.script: Iterable[Any] | None = [{"n": 1}, {"n": 2}]
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.aborted_at: dict[str, float] = {}
        self.delivered: collections.Counter[str] = collections.Counter()
        self._jobs: dict[str, asyncio.Task[None]] = {}

    def abort(self, rid: str) -> None:
        """The registry's ``on_abort``: record it and drop the request's job."""
        self.aborted.append(rid)
        self.aborted_at[rid] = time.perf_counter()
        job = self._jobs.pop(rid, None)
        if job is not None:
            job.cancel()
        self.signal()

    def submit(
        self, source: tether.Stream | tether.Batch | str, script: Iterable[Any] | None = None
    ) -> None:
        """Play ``script`` (default: :attr:`script`) for each request of ``source``."""
        if isinstance(source, str):
            rids: tuple[str, ...] = (source,)
        else:
            rids = source.rids if isinstance(source, tether.Batch) else (source.rid,)
        steps = self.script if script is None else script
        for rid in rids:
            self.submitted.append(rid)
            if steps is not None:
                job = asyncio.create_task(self._play(rid, steps))
                self._jobs[rid] = job
                job.add_done_callback(lambda done, rid=rid: self._done(rid, done))
        self.signal()

    def _done(self, rid: str, job: asyncio.Task[None]) -> None:
        if self._jobs.get(rid) is job:
            del self._jobs[rid]
        self.signal()

    @property
    def running(self) -> int:
        """How many scripts are still playing."""
        return len(self._jobs)

    async def _play(self, rid: str, steps: Iterable[Any]) -> None:
        pending = iter(steps)
        step = next(pending, _END)
        while step is not _END:
            upcoming = next(pending, _END)
            if step is HANG:
                await self.until(lambda: rid not in self.registry)
                return
            if isinstance(step, asyncio.Event):
                await step.wait()
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, BaseException):
                self.registry.fail(rid, step)
                return
            elif callable(step):
                step()  # a signal to the test, in the engine's own step
            else:
                if not self.registry.deliver(rid, step, finished=upcoming is _END):
                    return  # the request is gone
                self.delivered[rid] += 1
            step = upcoming

    async def stop(self) -> None:
        """Cancel every script still playing and wait for them."""
        jobs = set(self._jobs.values())
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.wait(jobs)


def tokens(prompt: str, count: int) -> list[dict[str, str]]:
    """``count`` outputs for ``prompt``, each a token that names its prompt and place."""
    return [{"text": f" {prompt}#{position}"} for position in range(count)]


def expected_text(prompt: str, count: int) -> str:
    """The text of :func:`tokens` put together: what a client must have seen."""
    return "".join(token["text"] for token in tokens(prompt, count))


def merge_outputs(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """The registry's ``merge`` for :func:`tokens`: the texts concatenate."""
    return {"text": older["text"] + newer["text"]}
