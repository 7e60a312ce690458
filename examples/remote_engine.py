"""The example servers' engine when it runs in its own process (``--engine ADDRESS``).

:class:`RemoteEngine` has the calls ``api.Service`` and the servers make of the
in-process :class:`engine.Engine` (``submit``, ``abort``, ``running``, ``stats``,
``recent_aborts``, ``crashed``) and forwards them over ``tether_zmq``: a submission
becomes a message to ``engine_server.py``, an abort (the registry's ``on_abort``)
one more in that tick's abort message, and the engine's steps come back into the
registry. The ZeroMQ socket is opened by :meth:`running`, in the app's lifespan
(``cleanup_ctx`` on aiohttp): after the fork, in each worker.

With no engine up, ``submit`` raises ``tether_zmq.EngineUnavailable``, a
``tether.TetherError``: the servers answer 503 with ``Retry-After`` at once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import tether
from tether_zmq import EngineClient

__all__ = ["RemoteEngine", "RemoteStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteStats:
    """What this worker knows of the engine: its link's counters (``/stats``)."""

    link: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"remote": True, **self.link}


class RemoteEngine:
    """The engine in another process, seen from one front worker."""

    def __init__(self, address: str) -> None:
        self.client = EngineClient(address)
        self._aborts: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)

    @contextlib.asynccontextmanager
    async def running(self, registry: tether.Registry) -> AsyncIterator[RemoteEngine]:
        """Link to the engine for the duration of the block (the app's lifespan)."""
        async with self.client.running(registry):
            yield self

    def submit(self, rid: str, prompt: str, max_tokens: int) -> None:
        """Send the request to the engine; raises ``EngineUnavailable`` (503) if none."""
        self.client.submit(rid, {"prompt": prompt, "max_tokens": max_tokens})

    def abort(self, rid: str) -> None:
        """The registry's ``on_abort``: batched to the engine, and noted for ``/metrics/aborts``."""
        self._aborts.append((rid, time.monotonic()))
        self.client.on_abort(rid)

    @property
    def crashed(self) -> bool:
        """Whether no engine is linked now (``/health`` answers 503)."""
        return not self.client.ready

    def stats(self) -> RemoteStats:
        stats = self.client.stats()
        return RemoteStats({name: getattr(stats, name) for name in stats.__slots__})

    def recent_aborts(self) -> list[tuple[str, float]]:
        return list(self._aborts)
