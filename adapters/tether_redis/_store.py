"""RedisStore: the logs of resumable streams in Redis, so that a reconnect continues
on any front worker.

The worker that owns a request (its producer delivers there) keeps the stream's
:class:`~tether.resume.Channel` in process, as :class:`~tether.resume.MemoryStore` does, and
copies every event to a Redis stream ``<prefix><token>:log`` (``XADD`` with
``MAXLEN``), ending it with an end entry. A reconnect on that same worker is served
from process; on another worker, from a local mirror channel (``_mirror``) fed with
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
import logging
import weakref
from typing import Any, Final

from redis.asyncio import Redis
from redis.exceptions import RedisError

import tether
import tether.resume
from tether.http import error_response
from tether.resume import Channel, Follower, new_token

from ._ear import Ear, Fields, text
from ._mirror import Mirror

__all__ = ["RedisStore"]

logger = logging.getLogger("tether.redis")


_DUMPS: Final = tether.SSE().dumps
_CLOSE_TIMEOUT: Final = 2.0
"""Seconds :meth:`RedisStore.aclose` gives the writers to put their end entries."""
_GONE_MS: Final = 1000
"""How long the keys of a stream that is resumable no more linger (for clients
elsewhere to read its end entry)."""
_WRITES: Final = 8
"""How many writes to Redis a store has in flight at most (each holds a connection)."""


class RedisStore(tether.resume.MemoryStore):
    """Resumable streams recorded in Redis Streams as well as in this process.

    :param client: a ``redis.asyncio.Redis`` client that returns bytes (the default,
        ``decode_responses=False``); the store does not close it.
    :param prefix: the prefix of every key the store writes.
    :param block: seconds one ``XREAD BLOCK`` waits; also how often leases and
        expiries are renewed.
    :raises ValueError: a non-positive ``block``.
    """

    __slots__ = ("_mirrors", "_writers", "block_ms", "client", "ear", "prefix", "worker", "writes")

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
        self._mirrors: weakref.WeakSet[Mirror] = weakref.WeakSet()
        """The clients here of streams owned elsewhere (ended when this store closes)."""
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
        ctl = self.key(channel.token, "ctl")
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(
                    meta,
                    mapping={
                        "rid": channel.rid,
                        "w": self.worker,
                        "m": channel.max_events,
                        "b": channel.max_bytes or 0,
                    },
                )
                # The control stream exists from now on (others post to it only if it does).
                pipe.xadd(ctl, {"op": "open", "w": self.worker})
                for key in (meta, ctl):
                    pipe.pexpire(key, _keep_ms(channel))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            # Redis is an extra reach, not a dependency of the stream: it goes on,
            # resumable on this worker only (its writer stops at its first write).
            logger.warning(
                "resumable request %r: Redis is unreachable (%s); it resumes on this worker only",
                channel.rid,
                exc,
            )

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
        """``writer`` is over: a later event of its channel may start another (but a
        writer that failed stays, inert, until its channel is forgotten)."""
        if self._writers.get(token) is writer:
            del self._writers[token]

    # -- any worker ----------------------------------------------------------------------

    async def follow(self, token: str, after: int) -> Follower | None:
        """A new client of the stream of ``token``: from this process if it owns it,
        else from Redis.

        :raises ConnectionError: Redis cannot be reached (the stream may exist: the
            answer is a 503, not a 404).
        """
        if self.channel(token) is not None or not _plain(token):
            return await super().follow(token, after)
        mirror = Mirror(self, token, after)
        try:
            follower = await mirror.start()
        except (RedisError, OSError) as exc:
            raise ConnectionError(f"Redis cannot be reached: {exc}") from exc
        if follower is not None:
            self._mirrors.add(mirror)
        return follower

    async def aclose(self) -> None:
        """Abort every stream still running and let each writer put its end entry in
        Redis (bounded), so that clients on other workers are told; end every client
        here of a stream owned elsewhere (its owner parks it); then end every task."""
        self.abort_all()
        tasks = [writer.task for writer in self._writers.values() if writer.task is not None]
        # The clients here of streams owned elsewhere end too; each owner is told.
        farewells = [mirror.close() for mirror in list(self._mirrors)]
        tasks += [self.spawn(farewell) for farewell in farewells if farewell is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT)
        await super().aclose()

    async def cancel(self, token: str) -> bool:
        """Stop the stream of ``token``, here or on the worker that owns it.

        :raises ConnectionError: Redis cannot be reached.
        """
        if self.channel(token) is not None or not _plain(token):
            return await super().cancel(token)
        try:
            if not await self.client.exists(self.key(token, "meta")):
                return False
            ctl = self.key(token, "ctl")  # (NOMKSTREAM: never one with no expiry)
            posted: Any = await self.client.xadd(
                ctl, {"op": "cancel", "w": self.worker}, nomkstream=True
            )
            if posted is None:  # the owner forgot it since
                return False
        except (RedisError, OSError) as exc:
            raise ConnectionError(f"Redis cannot be reached: {exc}") from exc
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
        "failed",
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
        self.failed = False
        """Redis failed it: the channel stays resumable here only, and this writer
        stays in its store's table (inert) so that no later event starts another."""
        self.task: asyncio.Task[None] | None = None

    def put(self, outputs: list[Any]) -> None:
        if self.failed:
            return
        first = self._channel.count - len(outputs) + 1
        self._outbox.extend(
            {"n": str(n), "d": _DUMPS(output).decode()} for n, output in enumerate(outputs, first)
        )
        self._wake.set()

    def end(self, error: tether.TetherError | None) -> None:
        if self.failed:
            return
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
        if self.failed:
            return
        self._outbox.append({"ctl": "attach"})
        self._wake.set()

    def forgotten(self) -> None:
        self._forgotten = True
        self._wake.set()
        if self.failed:  # (its task is over: nothing else takes it out of the table)
            self._store.done(self, self._channel.token)

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
            self.failed = True
            self._outbox = []
            logger.error(
                "resumable request %r: writing to Redis failed (%s); it resumes on this "
                "worker only from now on",
                channel.rid,
                exc,
            )
        finally:
            if not self.failed or self._forgotten:
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
            # A key that XADD just made has no expiry: set it in the same round trip, so
            # that an owner killed before its first upkeep leaves nothing for ever.
            keep = _keep_ms(self._channel)
            for key in keys[:2]:
                pipe.pexpire(key, keep)
            await pipe.execute()

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """The owner's ear: clients attaching and leaving elsewhere, Stop."""
        store, channel = self._store, self._channel
        op, who = text(fields, b"op"), text(fields, b"w")
        if op == "cancel":
            self._stop()
        elif who == store.worker:
            pass
        elif op == "attach":
            self._remote = text(fields, b"f")
            channel.attach_remote()
        elif op == "detach" and self._remote is not None and text(fields, b"f") == self._remote:
            self._remote = None
            channel.detach_remote(int(text(fields, b"pos") or 0))
        return True

    async def tick(self) -> bool:
        """A client elsewhere whose lease lapsed is gone; a stream's keys live on while
        the owner holds it."""
        store, channel = self._store, self._channel
        lease = store.key(channel.token, "lease")
        if self._remote is not None and not await store.client.exists(lease):
            self._remote = None  # the worker of that client is gone
            channel.detach_remote(channel.sent)
        if not channel.ended:
            await self._expire(self._keys, _keep_ms(channel))
        elif not self._forgotten:
            # The owner holds an ended stream until a grace period after its last client
            # left, however long that client stayed: so do the keys.
            await self._expire(self._keys, int(channel.grace * 1000) + 2 * store.block_ms)
        return True

    def _stop(self) -> None:
        """Stop, from any worker: abort at once, and forget."""
        channel = self._channel
        self._store.forget(channel)
        if not channel.ended:
            channel.abort(tether.AbortReason.CANCELLED)
        follower = channel.follower
        if follower is not None:
            follower.detach(tether.AbortReason.CANCELLED)
