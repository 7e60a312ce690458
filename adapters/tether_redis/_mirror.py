"""A reconnect on a worker that does not own its stream: a local channel fed from
Redis (the backlog, then the live tail through the store's :class:`~._ear.Ear`), and
the control messages that keep the owner informed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

import tether
from tether.resume import Channel, Follower, new_token

from ._ear import Ear, Fields, text

__all__ = ["Host", "Mirror", "end_error"]

logger = logging.getLogger("tether.redis")

_NO_CAP = 1 << 62
"""The cap of a stream whose owner did not publish one."""

_CATCH_UP = 2.0
"""Seconds a reconnect whose Last-Event-ID is ahead of the log in Redis waits for the
owner's writes to land before the id counts as unknown (a 404)."""


class Host(Protocol):
    """What a mirror needs of its store (a ``RedisStore``)."""

    client: Redis
    block_ms: int
    worker: str
    ear: Ear
    writes: asyncio.Semaphore

    def key(self, token: str, kind: str) -> str:
        """The Redis key of ``token``'s ``log``, ``ctl``, ``meta`` or ``lease``."""
        ...

    def spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``job`` as a task the store owns."""
        ...


class Mirror:
    """A reconnect on a worker that does not own the stream: a local channel fed from
    Redis, and the control messages that keep the owner informed. It is the keeper
    of that channel (no store holds it)."""

    __slots__ = ("__weakref__", "_after", "_channel", "_closing", "_fid", "_store", "_token")

    def __init__(self, store: Host, token: str, after: int) -> None:
        self._store = store
        self._token = token
        self._after = after
        self._fid = new_token()
        self._channel: Channel | None = None
        self._closing = False

    def _key(self, kind: str) -> str:
        return self._store.key(self._token, kind)

    async def start(self) -> Follower | None:
        store, after = self._store, self._after
        client = store.client
        meta: Any = await client.hgetall(self._key("meta"))
        if not meta:
            return None
        rid = meta[b"rid"].decode()
        # The owner's cap: the most events this client may lag by, and keep.
        max_events = int(meta.get(b"m") or _NO_CAP)
        max_bytes = int(meta.get(b"b") or 0) or None
        log = self._key("log")
        entries: Any = await client.xrange(log)
        events: list[Any] = []
        first = count = 0
        end: Fields | None = None
        last_id: Any = "0-0"
        deadline = asyncio.get_running_loop().time() + _CATCH_UP
        while True:
            for entry_id, fields in entries:
                last_id = entry_id
                if b"end" in fields:
                    end = fields
                    continue
                count = int(fields[b"n"])
                first = first or count
                events.append(json.loads(fields[b"d"]))
            # The client saw events the owner sent before its writes reached Redis:
            # wait (bounded) for the log to catch up rather than call the id unknown.
            left = deadline - asyncio.get_running_loop().time()
            if end is not None or after <= count or left <= 0:
                break
            more: Any = await client.xread({log: last_id}, block=max(1, int(left * 1000)))
            if not more:
                break
            entries = more[0][1]
        first = first or count + 1
        if (end is not None and end[b"end"] == b"aborted") or not first - 1 <= after <= count:
            return None
        channel = Channel(
            self,
            rid,
            self._token,
            grace=3600.0,
            max_events=max_events,
            abort=self._abort,
            max_bytes=max_bytes,
        )
        channel.preload(events, first)
        self._channel = channel
        follower = Follower(channel, after)
        # (NOMKSTREAM: a control stream that is gone is an owner that is gone; one
        # made here would have no expiry)
        ctl_id: Any = await client.xadd(
            self._key("ctl"), {"op": "attach", "w": store.worker, "f": self._fid}, nomkstream=True
        )
        if ctl_id is None:  # the owner forgot it since
            return None
        await client.set(self._key("lease"), self._fid, px=3 * store.block_ms)
        channel.attach(follower)
        if end is not None:
            channel.end(end_error(rid, end))
        else:
            await store.ear.listen(self, {log: last_id, self._key("ctl"): ctl_id})
        return follower

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """Follow the log and the control stream until the stream ends or this client
        is replaced, stopped or gone."""
        channel = self._channel
        if channel is None or channel.follower is None:
            return False
        if key == self._key("log"):
            return self._record(channel, fields)
        op = text(fields, b"op")
        if op == "cancel":
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.CANCELLED))
            return False
        if op == "attach" and text(fields, b"f") != self._fid:
            channel.attach_remote()  # a newer client, elsewhere: this one ends
            return False
        return True

    async def tick(self) -> bool:
        """Hold this client's lease; end if the owner is gone."""
        channel, store = self._channel, self._store
        if channel is None or channel.follower is None:
            return False
        async with store.writes, store.client.pipeline(transaction=False) as pipe:
            pipe.set(self._key("lease"), self._fid, px=3 * store.block_ms)
            pipe.exists(self._key("meta"))
            _, alive = await pipe.execute()
        if not alive:  # the owner is gone (its keys expired): nobody will write more
            gone = "the worker that ran this request is gone"
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.SERVER, gone))
            return False
        return True

    def close(self) -> Coroutine[Any, Any, None] | None:
        """This worker is shutting down: its client is told (a 503 error event, after
        the events it holds) and it stops following.

        :returns: the message that tells the owner the client left (for the store to
            send, bounded), so that it parks at once rather than when the lease lapses;
            ``None`` when this client is no longer attached.
        """
        self._store.ear.drop(self)
        channel = self._channel
        follower = None if channel is None else channel.follower
        if channel is None or follower is None or self._closing:
            return None
        self._closing = True  # (its client leaving now tells the owner nothing more)
        if not channel.ended:
            down = "the server is shutting down"
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.SERVER, down))
        fields = {"op": "detach", "w": self._store.worker, "f": self._fid, "pos": str(follower.pos)}
        return self._send(fields)

    def _record(self, channel: Channel, fields: Fields) -> bool:
        """One entry of the log; whether the stream goes on."""
        if b"end" in fields:
            channel.end(end_error(channel.rid, fields))
            return False
        if int(fields[b"n"]) != channel.count + 1:  # trimmed before it was read
            channel.end(tether.ConsumerTooSlow(channel.rid, channel.max_events))
            return False
        channel.append([json.loads(fields[b"d"])])
        return not channel.ended  # (the append may have ended a client that lags)

    def _abort(self, reason: tether.AbortReason) -> bool:
        """Only the owner aborts: ask it to (this worker could not encode an output).
        A client here that lags by more than the cap only ends, with an error: the
        request goes on for a reconnect (the owner's own cap guards it)."""
        channel = self._channel
        if reason is tether.AbortReason.CONSUMER_TOO_SLOW and channel is not None:
            if not channel.ended:
                channel.end(tether.ConsumerTooSlow(channel.rid, channel.max_events))
            return False
        self._store.spawn(self._send({"op": "cancel", "w": self._store.worker}))
        return True

    async def _send(self, fields: dict[str, str]) -> None:
        """Tell the owner (a task of its own: a Redis that fails is logged, not raised
        into nobody's hands); nothing once the owner's control stream is gone."""
        try:
            async with self._store.writes:  # (the store's bound on writes in flight)
                await self._store.client.xadd(self._key("ctl"), fields, nomkstream=True)  # type: ignore[arg-type]
        except (RedisError, OSError) as exc:
            logger.warning("resumable request: the owner could not be told (%s)", exc)

    # -- Keeper ------------------------------------------------------------------------

    def holds(self, channel: Channel) -> bool:
        return False

    def forget(self, channel: Channel) -> None:
        pass

    def recorded(self, channel: Channel, outputs: list[Any]) -> None:
        pass

    def ended(self, channel: Channel) -> None:
        pass

    def attached(self, channel: Channel, follower: Follower) -> None:
        pass

    def detached(self, channel: Channel, follower: Follower) -> None:
        self._store.ear.drop(self)
        if self._closing:  # (close() told the owner)
            return
        fields = {"op": "detach", "w": self._store.worker, "f": self._fid, "pos": str(follower.pos)}
        self._store.spawn(self._send(fields))


def end_error(rid: str, end: Fields) -> tether.TetherError | None:
    kind = end.get(b"end")
    if kind == b"ok":
        return None
    if kind == b"aborted":
        return tether.Aborted(rid, tether.AbortReason(text(end, b"reason") or "server"))
    return tether.Aborted(rid, tether.AbortReason.SERVER, text(end, b"m"))
