"""RedisStore: the logs of resumable streams in Redis, so that a reconnect continues
on any front worker.

The worker that owns a request (its producer delivers there) keeps the stream's
:class:`~tether.http.Channel` in process, as :class:`~tether.MemoryStore` does, and
copies every event to a Redis stream ``<prefix><token>:log`` (``XADD`` with
``MAXLEN``), ending it with an end entry. A reconnect on that same worker is served
from process; on another worker, from a local mirror channel fed by a task that reads
the backlog (``XRANGE``) and then the live tail (``XREAD BLOCK``).

The workers speak through a second stream, ``<prefix><token>:ctl``: a client that
attaches (the newest wins: every other one ends), a client that leaves (the owner
parks the request and starts its grace period), and Stop (the owner aborts at once;
its store's one reader is blocked on that stream, so it hears it within a round
trip). However many streams a worker holds, it reads them all with one blocked
connection (``_ear``), and writes through a bounded number at a time. Only the
owner aborts, so ``on_abort`` runs exactly once. A worker whose client is attached
holds a lease (``<prefix><token>:lease``) that it renews while it reads; a worker that
dies lets it lapse, and the owner parks the request then.

Every key expires: while the stream runs, the owner renews them; once it ended, they
live for the grace period. A stream that was aborted is resumable nowhere.
Departures from the in-process store: a failure reaches a client on another worker
as a 503 with the failure's public message (the exception itself stays with the
owner), and a client on another worker that reads too slowly for ``MAXLEN`` ends with
an error instead of making the owner abort.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

import tether
from tether.http import Channel, Follower, error_response, new_token

from ._ear import Ear, Fields

__all__ = ["RedisStore"]

logger = logging.getLogger("tether.redis")

_Fields = Fields

_DUMPS: Final = tether.SSE().dumps
_CLOSE_TIMEOUT: Final = 2.0
"""Seconds :meth:`RedisStore.aclose` gives the writers to put their end entries."""
_GONE_MS: Final = 1000
"""How long the keys of a stream that is resumable no more linger (for clients
elsewhere to read its end entry)."""
_WRITES: Final = 8
"""How many writes to Redis a store has in flight at most (each holds a connection)."""


class RedisStore(tether.MemoryStore):
    """Resumable streams recorded in Redis Streams as well as in this process.

    :param client: a ``redis.asyncio.Redis`` client that returns bytes (the default,
        ``decode_responses=False``); the store does not close it.
    :param prefix: the prefix of every key the store writes.
    :param block: seconds one ``XREAD BLOCK`` waits; also how often leases and
        expiries are renewed.
    :raises ValueError: a non-positive ``block``.
    """

    __slots__ = ("_writers", "block_ms", "client", "ear", "prefix", "worker", "writes")

    def __init__(
        self, client: Redis, *, prefix: str = "tether:resume:", block: float = 1.0
    ) -> None:
        super().__init__()
        if not block > 0:
            raise ValueError(f"block must be a positive number of seconds, got {block}")
        self.client = client
        self.prefix = prefix
        self.block_ms = max(1, int(block * 1000))
        self.worker = new_token()
        """This store's id in control messages."""
        self._writers: dict[str, _Writer] = {}
        self.writes = asyncio.Semaphore(_WRITES)
        """Bounds the writes in flight (each holds one of the client's connections)."""
        self.ear = Ear(client, f"{prefix}{self.worker}:wake", self.block_ms, self.spawn)
        """The one reader of every control stream and mirrored log of this worker."""

    def key(self, token: str, kind: str) -> str:
        """The Redis key of ``token``'s ``log``, ``ctl``, ``meta`` or ``lease``."""
        return f"{self.prefix}{token}:{kind}"

    # -- the owner's side ------------------------------------------------------------

    async def opened(self, follower: Follower) -> None:
        """Publish the token before its client sees it: a reconnect or a Stop on any
        worker finds it from then on."""
        channel = self.channel(follower.token)
        if channel is None:
            return
        meta = self.key(channel.token, "meta")
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(meta, mapping={"rid": channel.rid, "w": self.worker})
            pipe.pexpire(meta, _keep_ms(channel))
            await pipe.execute()

    def _writer(self, channel: Channel) -> _Writer | None:
        """The writer of ``channel``, started at its first event (which may come while
        the channel is being opened, before ``open()`` returns: an eager task)."""
        writer = self._writers.get(channel.token)
        if writer is None and self.holds(channel):
            writer = self._writers[channel.token] = _Writer(self, channel)
            writer.task = self.spawn(writer.run())
        return writer

    def recorded(self, channel: Channel, outputs: list[Any]) -> None:
        writer = self._writer(channel)
        if writer is not None:
            writer.put(outputs)

    def ended(self, channel: Channel) -> None:
        writer = self._writer(channel)
        if writer is not None:
            writer.end(channel.error)

    def attached(self, channel: Channel, follower: Follower) -> None:
        writer = self._writer(channel)
        if writer is not None:  # (a reconnect here: the clients elsewhere end)
            writer.attach_here()

    def forget(self, channel: Channel) -> None:
        super().forget(channel)
        writer = self._writers.get(channel.token)
        if writer is not None:
            writer.forgotten()

    def done(self, writer: _Writer, token: str) -> None:
        if self._writers.get(token) is writer:
            del self._writers[token]

    # -- any worker ----------------------------------------------------------------------

    async def follow(self, token: str, after: int) -> Follower | None:
        if self.channel(token) is not None or not _plain(token):
            return await super().follow(token, after)
        return await _Mirror(self, token, after).start()

    async def aclose(self) -> None:
        """Abort every stream still running and let each writer put its end entry in
        Redis (bounded), so that clients on other workers are told; then end every task."""
        self.abort_all()
        writers = [writer.task for writer in self._writers.values() if writer.task is not None]
        if writers:
            await asyncio.wait(writers, timeout=_CLOSE_TIMEOUT)
        await super().aclose()

    async def cancel(self, token: str) -> bool:
        if self.channel(token) is not None or not _plain(token):
            return await super().cancel(token)
        if not await self.client.exists(self.key(token, "meta")):
            return False
        await self.client.xadd(self.key(token, "ctl"), {"op": "cancel", "w": self.worker})
        return True


def _keep_ms(channel: Channel) -> int:
    """How long the keys of a running stream live unless renewed: a stalled owner's
    lapse once its grace period (and a margin) passed."""
    return int((channel.grace + 60) * 1000)


def _plain(token: str) -> bool:
    """Whether ``token`` could be one (so that it may name a key)."""
    return bool(token) and len(token) <= 64 and token.replace("-", "").replace("_", "").isalnum()


class _Writer:
    """The owner's copy of one channel to Redis, and its watch over the control stream."""

    __slots__ = (
        "_channel",
        "_ended",
        "_forgotten",
        "_keys",
        "_outbox",
        "_remote",
        "_store",
        "_wake",
        "task",
    )

    def __init__(self, store: RedisStore, channel: Channel) -> None:
        self._store = store
        self._channel = channel
        self._keys = tuple(store.key(channel.token, kind) for kind in ("log", "ctl", "meta"))
        self._outbox: list[dict[str, str]] = []
        self._wake = asyncio.Event()
        self._ended = False
        self._forgotten = False
        self._remote: str | None = None  # the client attached on another worker, if any
        self.task: asyncio.Task[None] | None = None

    def put(self, outputs: list[Any]) -> None:
        first = self._channel.count - len(outputs) + 1
        self._outbox.extend(
            {"n": str(n), "d": _DUMPS(output).decode()} for n, output in enumerate(outputs, first)
        )
        self._wake.set()

    def end(self, error: tether.TetherError | None) -> None:
        if error is None:
            entry = {"end": "ok"}
        elif isinstance(error, tether.Aborted):
            entry = {"end": "aborted", "reason": error.reason.value}
        else:
            body = error_response(error).body  # what a client may see of it
            entry = {"end": "failed", "m": str(body["error"]["message"])}
        self._outbox.append(entry)
        self._ended = True
        self._wake.set()

    def attach_here(self) -> None:
        self._outbox.append({"ctl": "attach"})
        self._wake.set()

    def forgotten(self) -> None:
        self._forgotten = True
        self._wake.set()

    async def run(self) -> None:
        """Copy the events as they come, until the end entry is written; then keep the
        keys for the grace period (or drop them, aborted); listen to the control stream.
        If Redis fails, the stream goes on resumable in this process only."""
        store, channel = self._store, self._channel
        keys = self._keys
        try:
            await store.ear.listen(self, {keys[1]: "0-0"})
            while True:
                await self._flush(keys)
                if self._outbox:
                    continue  # (more came during that flush: the end entry, say)
                if self._ended:
                    break
                self._wake.clear()
                await self._wake.wait()
            await self._expire(keys, _GONE_MS if self._forgotten else int(channel.grace * 1000))
            while not self._forgotten:
                self._wake.clear()
                await self._wake.wait()
            await self._expire(keys, _GONE_MS)
            await store.client.delete(keys[2])  # resumable nowhere from now on
        except (RedisError, OSError) as exc:
            logger.error(
                "resumable request %r: writing to Redis failed (%s); it resumes on this "
                "worker only from now on",
                channel.rid,
                exc,
            )
        finally:
            store.done(self, channel.token)
            store.ear.drop(self)

    async def _expire(self, keys: tuple[str, ...], ms: int) -> None:
        async with self._store.writes, self._store.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.pexpire(key, ms)
            await pipe.execute()

    async def _flush(self, keys: tuple[str, ...]) -> None:
        outbox, self._outbox = self._outbox, []
        if not outbox:
            return
        store = self._store
        maxlen = self._channel.max_events + 1  # (and the end entry)
        async with store.writes, store.client.pipeline(transaction=False) as pipe:
            for entry in outbox:
                if "ctl" in entry:
                    pipe.xadd(keys[1], {"op": "attach", "w": store.worker})
                else:
                    pipe.xadd(keys[0], entry, maxlen=maxlen, approximate=False)  # type: ignore[arg-type]
            await pipe.execute()

    def heard(self, key: str, entry_id: Any, fields: _Fields) -> bool:
        """The owner's ear: clients attaching and leaving elsewhere, Stop."""
        store, channel = self._store, self._channel
        op, who = _text(fields, b"op"), _text(fields, b"w")
        if op == "cancel":
            self._stop()
        elif who == store.worker:
            pass
        elif op == "attach":
            self._remote = _text(fields, b"f")
            channel.attach_remote()
        elif op == "detach" and self._remote is not None and _text(fields, b"f") == self._remote:
            self._remote = None
            channel.detach_remote(int(_text(fields, b"pos") or 0))
        return True

    async def tick(self) -> bool:
        """A client elsewhere whose lease lapsed is gone; a running stream's keys live on."""
        store, channel = self._store, self._channel
        lease = store.key(channel.token, "lease")
        if self._remote is not None and not await store.client.exists(lease):
            self._remote = None  # the worker of that client is gone
            channel.detach_remote(channel.sent)
        if not channel.ended:
            await self._expire(self._keys, _keep_ms(channel))
        return True

    def _stop(self) -> None:
        """Stop, from any worker: abort at once, and forget."""
        channel = self._channel
        self._store.forget(channel)
        if not channel.ended:
            channel.abort(tether.AbortReason.CANCELLED)
        follower = channel.follower
        if follower is not None:
            follower.cancel(tether.AbortReason.CANCELLED)


class _Mirror:
    """A reconnect on a worker that does not own the stream: a local channel fed from
    Redis, and the control messages that keep the owner informed. It is the keeper
    of that channel (no store holds it)."""

    __slots__ = ("_after", "_channel", "_fid", "_store", "_token")

    def __init__(self, store: RedisStore, token: str, after: int) -> None:
        self._store = store
        self._token = token
        self._after = after
        self._fid = new_token()
        self._channel: Channel | None = None

    def _key(self, kind: str) -> str:
        return self._store.key(self._token, kind)

    async def start(self) -> Follower | None:
        store, after = self._store, self._after
        client = store.client
        meta: Any = await client.hgetall(self._key("meta"))
        if not meta:
            return None
        rid = meta[b"rid"].decode()
        entries: Any = await client.xrange(self._key("log"))
        events: list[Any] = []
        first = count = 0
        end: _Fields | None = None
        for _entry_id, fields in entries:
            if b"end" in fields:
                end = fields
                continue
            count = int(fields[b"n"])
            first = first or count
            events.append(json.loads(fields[b"d"]))
        first = first or count + 1
        if (end is not None and end[b"end"] == b"aborted") or not first - 1 <= after <= count:
            return None
        channel = Channel(
            self, rid, self._token, grace=3600.0, max_events=1 << 62, abort=self._abort
        )
        channel.events = events
        channel.first = first
        channel.count = count
        self._channel = channel
        follower = Follower(channel, after)
        ctl_id = await client.xadd(
            self._key("ctl"), {"op": "attach", "w": store.worker, "f": self._fid}
        )
        await client.set(self._key("lease"), self._fid, px=3 * store.block_ms)
        channel.attach(follower)
        if end is not None:
            channel.end(_error(rid, end))
        else:
            last_id = entries[-1][0] if entries else "0-0"
            await store.ear.listen(self, {self._key("log"): last_id, self._key("ctl"): ctl_id})
        return follower

    def heard(self, key: str, entry_id: Any, fields: _Fields) -> bool:
        """Follow the log and the control stream until the stream ends or this client
        is replaced, stopped or gone."""
        channel = self._channel
        if channel is None or channel.follower is None:
            return False
        if key == self._key("log"):
            return self._record(channel, fields)
        op = _text(fields, b"op")
        if op == "cancel":
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.CANCELLED))
            return False
        if op == "attach" and _text(fields, b"f") != self._fid:
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

    def _record(self, channel: Channel, fields: _Fields) -> bool:
        """One entry of the log; whether the stream goes on."""
        if b"end" in fields:
            channel.end(_error(channel.rid, fields))
            return False
        if int(fields[b"n"]) != channel.count + 1:  # trimmed before it was read
            channel.end(tether.ConsumerTooSlow(channel.rid, channel.max_events))
            return False
        channel.append([json.loads(fields[b"d"])])
        return True

    def _abort(self, reason: tether.AbortReason) -> bool:
        """Only the owner aborts: ask it to (this worker could not encode an output)."""
        self._store.spawn(self._send({"op": "cancel", "w": self._store.worker}))
        return True

    async def _send(self, fields: dict[str, str]) -> None:
        await self._store.client.xadd(self._key("ctl"), fields)  # type: ignore[arg-type]

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
        fields = {"op": "detach", "w": self._store.worker, "f": self._fid, "pos": str(follower.pos)}
        self._store.spawn(self._send(fields))


def _text(fields: _Fields, name: bytes) -> str | None:
    value = fields.get(name)
    return None if value is None else value.decode()


def _error(rid: str, end: _Fields) -> tether.TetherError | None:
    kind = end.get(b"end")
    if kind == b"ok":
        return None
    if kind == b"aborted":
        return tether.Aborted(rid, tether.AbortReason(_text(end, b"reason") or "server"))
    return tether.Aborted(rid, tether.AbortReason.SERVER, _text(end, b"m"))
