"""One blocking read per store: the Redis streams that every resumable stream of this
worker listens to (an owner's control stream, a mirror's log and control stream) are
read by a single ``XREAD BLOCK``, and their periodic upkeep (leases, expiries) runs
from the same task.

One blocked connection per stream would not scale: ``redis.asyncio``'s pool holds
100 connections by default, and a worker with that many resumable streams would have
its writers fail with ``MaxConnectionsError``. A listener that joins while the read
is blocked pokes the worker's wake stream, so that its first entries are not held up
for a whole block period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

__all__ = ["Ear", "Fields", "Listener", "text"]

logger = logging.getLogger("tether.redis")

Fields = dict[bytes, bytes]


class Listener(Protocol):
    """Something that listens to some Redis streams through an :class:`Ear`."""

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """One entry of ``key``; whether to go on listening."""
        ...

    async def tick(self) -> bool:
        """Upkeep, once per block period (leases, expiries); whether to go on."""
        ...


class Ear:
    """The one reader of a store's listened streams.

    :param client: the store's Redis client.
    :param wake_key: this worker's wake stream (poked when a listener joins).
    :param block_ms: how long one ``XREAD`` blocks; also the upkeep period.
    :param spawn: runs a task the store owns (and cancels when it closes).
    """

    __slots__ = ("_block_ms", "_client", "_keys", "_spawn", "_task", "_wake_id", "_wake_key")

    def __init__(
        self,
        client: Redis,
        wake_key: str,
        block_ms: int,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._client = client
        self._wake_key = wake_key
        self._block_ms = block_ms
        self._spawn = spawn
        self._keys: dict[str, tuple[Any, Listener]] = {}
        self._wake_id: Any = "0-0"
        self._task: asyncio.Task[None] | None = None

    async def listen(self, listener: Listener, keys: dict[str, Any]) -> None:
        """Deliver the entries of ``keys`` after the given ids to ``listener``."""
        for key, last in keys.items():
            self._keys[key] = (last, listener)
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run())
        else:  # the read in progress does not name these keys yet
            await self._client.xadd(self._wake_key, {"w": "1"}, maxlen=16)
            await self._client.pexpire(self._wake_key, 60_000)

    def drop(self, listener: Listener) -> None:
        """Deliver nothing more to ``listener``."""
        for key in [key for key, (_, held) in self._keys.items() if held is listener]:
            del self._keys[key]

    async def _run(self) -> None:
        failing = False
        upkept = time.monotonic()
        while self._keys:
            try:
                await self._read()
                now = time.monotonic()
                if now - upkept >= self._block_ms / 1000:
                    upkept = now
                    await self._upkeep()
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:
                    logger.warning("resumable streams: Redis failed (%s); retrying", exc)
                failing = True
                await asyncio.sleep(self._block_ms / 1000)

    async def _read(self) -> None:
        streams = {self._wake_key: self._wake_id}
        streams.update({key: last for key, (last, _) in self._keys.items()})
        answer: Any = await self._client.xread(streams, block=self._block_ms)  # type: ignore[arg-type]
        for raw, entries in answer or ():
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key == self._wake_key:
                self._wake_id = entries[-1][0]
                continue
            for entry_id, fields in entries:
                held = self._keys.get(key)
                if held is None:
                    break  # dropped, by itself or by an earlier entry
                listener = held[1]
                self._keys[key] = (entry_id, listener)
                if not listener.heard(key, entry_id, fields):
                    self.drop(listener)

    async def _upkeep(self) -> None:
        listeners = {id(listener): listener for _, listener in self._keys.values()}
        for listener in listeners.values():
            if not await listener.tick():
                self.drop(listener)


def text(fields: Fields, name: bytes) -> str | None:
    """The text of field ``name`` of an entry, or ``None`` if it has none."""
    value = fields.get(name)
    return None if value is None else value.decode()
