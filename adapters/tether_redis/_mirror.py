"""A reconnect on a worker that does not own its stream: a local channel fed from
Redis (the backlog, then the live tail through the store's :class:`~._ear.Ear`), and
the control messages that keep the owner informed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Protocol, TypeVar

from redis.asyncio import Redis

import tether
from tether.resume import Channel, Follower, new_token, wait_withdrawn

from ._ear import CTL_MAXLEN, Ear, Fields, StoreUnreachable, entry_order, lives, text

__all__ = ["Host", "Mirror", "end_error"]

logger = logging.getLogger("tether.redis")

T = TypeVar("T")

_NO_CAP = 1 << 62
"""The cap of a stream whose owner did not publish one."""

_CATCH_UP = 2.0
"""Seconds a reconnect whose Last-Event-ID is ahead of the log in Redis waits for the
owner's writes to land before the id counts as unknown (a 404); on a worker whose Redis
user may not block, ``block + timeout`` if that is longer (a poll period). The wait
holds no connection: the store's one reader follows the log meanwhile."""

_TELL_PAUSE: Final = 0.05
"""Seconds before the first retry of a message to the owner that Redis failed; each
next pause is twice as long, within a lease period in all (a few tries)."""

_UNREACHABLE = "the store of resumable streams cannot be reached; retry"


_MAX_ID: Final = 2**64 - 1
"""The largest number a Redis stream entry id holds (a client's id past it: past the end)."""


class Host(Protocol):
    """What a mirror needs of its store (a ``RedisStore``)."""

    block_ms: int
    lease_ms: int
    settle_ms: int
    timeout: float
    worker: str
    ear: Ear
    epoch: str
    settling: str

    def key(self, token: str, kind: str) -> str:
        """The Redis key of ``token``'s ``log``, ``ctl``, ``meta`` or ``lease``."""
        ...

    def spawn(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``job`` as a task the store owns."""
        ...

    async def command(self, job: Callable[[Redis], Awaitable[T]], *, upkeep: bool = False) -> T:
        """Run ``job`` on the client, bounded in time and concurrency."""
        ...

    async def absent(self, pipe_results: list[Any]) -> bool:
        """Whether a stream Redis does not hold is proven absent (a 404, not a 503): the
        last two answers (``EXISTS settling, epoch``) say Redis lost no state lately,
        and it evicted no key lately."""
        ...

    def closing(self) -> bool:
        """Whether the store began to close (a reconnect that completes after it ends)."""
        ...

    def unsettled(self) -> bool:
        """Whether Redis may lack streams that live, as far as the store knows without
        asking."""
        ...


class Mirror:
    """A reconnect on a worker that does not own the stream: a local channel fed from
    Redis, and the control messages that keep the owner informed. It is the keeper
    of that channel (no store holds it)."""

    __slots__ = (
        "__weakref__",
        "_after",
        "_announce",
        "_caught_up",
        "_channel",
        "_claim",
        "_closing",
        "_fid",
        "_missing",
        "_seen",
        "_starting",
        "_store",
        "_token",
    )

    def __init__(self, store: Host, token: str, after: int) -> None:
        self._store = store
        self._token = token
        self._after = after
        self._fid = new_token()
        self._channel: Channel | None = None
        self._claim = "0-0"
        """The place of this client's claim (its ``attach`` entry) in the control stream:
        only a claim after it ends this client."""
        self._closing = False
        self._caught_up: asyncio.Future[None] | None = None
        self._seen = 0.0  # when Redis last answered this mirror's upkeep
        self._missing: float | None = None  # since when its upkeep finds no meta
        self._announce = False  # this client must tell the owner again that it is here
        self._starting = True
        """:meth:`start` runs: the channel has no follower yet, and must keep listening
        (an upkeep meanwhile must not take it for a client that left)."""

    def _key(self, kind: str) -> str:
        return self._store.key(self._token, kind)

    async def start(self) -> Follower | None:
        """The follower of this reconnect, or ``None`` (no such stream, or no such
        event); each step bounded by the store.

        :raises StoreUnreachable: Redis cannot be reached or lost its state lately.
        """
        try:
            return await self._start()
        finally:
            self._starting = False

    async def _start(self) -> Follower | None:
        store, after = self._store, self._after
        log = self._key("log")

        async def read(client: Redis) -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.hgetall(self._key("meta"))
                # From the last event its client saw (the log must hold it, or the next),
                # not the whole log; and the log's last entry (its end, if it ended).
                pipe.xrange(log, min=f"{min(after, _MAX_ID)}-0")
                pipe.xrevrange(log, count=1)
                pipe.pttl(log)
                pipe.pttl(self._key("ctl"))
                pipe.exists(store.settling)  # (these two last: store.absent() reads them)
                pipe.exists(store.epoch)
                results: list[Any] = await pipe.execute()
                return results

        results = await store.command(read)
        meta, entries, last = results[0], results[1], results[2]
        if last and (not entries or entries[-1][0] != last[0][0]):
            entries = [*entries, last[0]]  # (the end, past what the client asked for)
        if not meta:
            # (a log or control stream that lives on, not the second a stream that
            # ended lingers, is a live stream whose meta alone Redis lost (one with no
            # event yet has no log): INFO or not, a 503 until its owner publishes it
            # again)
            if lives(results[3], results[4]) or not await store.absent(results):
                raise StoreUnreachable("Redis lost its state lately; its owner re-publishes it")
            return None
        rid = meta[b"rid"].decode()
        # The owner's cap: the most events this client may lag by, and keep.
        max_events = int(meta.get(b"m") or _NO_CAP)
        max_bytes = int(meta.get(b"b") or 0) or None
        events: list[Any] = []
        first = count = 0
        end: Fields | None = None
        last_id: Any = "0-0"
        for entry_id, fields in entries:
            last_id = entry_id
            if b"end" in fields:
                end = fields
                continue
            number = int(fields[b"n"])
            if number <= count:
                continue
            if count and number != count + 1:  # (a log published again in between)
                events, first = [], 0
            count = number
            first = first or count
            events.append(json.loads(fields[b"d"]))
        first = first or count + 1
        if end is not None and end[b"end"] == b"aborted":
            return None
        if (end is not None and after > count) or after < first - 1:
            # Past the end, or before what the log holds: unknown, unless Redis lost
            # state lately (its owner's copies since made a log that lacks the rest,
            # until it publishes the whole again).
            if not await store.absent(results):
                raise StoreUnreachable("Redis lost its state lately; its owner re-publishes it")
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
        if end is not None:
            channel.end(end_error(rid, end))
        elif after > count:
            # The client saw events the owner sent before its writes reached Redis:
            # wait (bounded, holding no connection) for the log to catch up rather
            # than call the id unknown.
            # (what its client saw must not count as unread: it is where it reads from)
            channel.sent = count
            loop = asyncio.get_running_loop()
            caught_up = self._caught_up = loop.create_future()
            began = loop.time()
            store.ear.listen(self, {log: last_id})
            try:
                while not caught_up.done():
                    # A worker whose user may not block polls: its first poll may come
                    # before the copy lands, the next a block period later (and takes up
                    # to the timeout): the wait covers it (the reader may learn that it
                    # polls during the wait, so this is asked again).
                    wait = _CATCH_UP
                    if store.ear.polling:
                        wait = max(wait, store.block_ms / 1000 + store.timeout)
                    left = began + wait - loop.time()
                    if left <= 0:
                        break
                    await asyncio.wait((caught_up,), timeout=left)
            except BaseException:  # cut (its client left): nothing follows the log for it
                store.ear.drop(self)
                raise
            finally:
                self._caught_up = None
            if channel.count < after:
                store.ear.drop(self)
                # Behind is not unknown while an owner may still be publishing what
                # Redis lacks (it failed, or restarted empty, lately): a 503, not a 404.
                if store.unsettled():  # (asks Redis nothing: 150 of these cost nothing)
                    raise StoreUnreachable("Redis lost its state lately; its owner re-publishes it")
                return None
        # (no claim: it would end the client reading elsewhere, for nobody)
        if wait_withdrawn():  # its client left, or its request ended, while it looked
            store.ear.drop(self)
            return None
        if store.closing():  # this worker shuts down: it would hold nothing after
            store.ear.drop(self)
            raise StoreUnreachable("this worker is shutting down")
        follower = Follower(channel, after)

        async def attach(client: Redis) -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(self._key("lease"), self._fid, px=store.lease_ms)
                # (NOMKSTREAM: a control stream that is gone is an owner that is gone,
                # or one that has not published it again since Redis lost it; one made
                # here would have no expiry)
                pipe.xadd(
                    self._key("ctl"),
                    {"op": "attach", "w": store.worker, "f": self._fid},
                    maxlen=CTL_MAXLEN,
                    nomkstream=True,
                )
                pipe.exists(self._key("meta"))
                pipe.exists(store.settling)  # (these two last: store.absent() reads them)
                pipe.exists(store.epoch)
                results: list[Any] = await pipe.execute()
                return results

        try:
            results = await store.command(attach)
            ctl_id = results[1]
            # (a meta still held is a live stream whose control stream Redis lost: its
            # owner publishes it again; no count of evictions is needed to know it)
            if ctl_id is None and (results[2] or not await store.absent(results)):
                raise StoreUnreachable("Redis lost its state lately; its owner re-publishes it")
        except asyncio.CancelledError:
            # Cut while its claim was on its way (its client left): the claim may have
            # landed, and the owner would keep this client for the newest: withdrawn.
            store.ear.drop(self)
            if not store.closing():  # (a closed store's tasks are ended by nobody)
                gone = {"op": "detach", "w": store.worker, "f": self._fid, "pos": str(after)}
                store.spawn(self._tell(gone))
            raise
        except BaseException:
            store.ear.drop(self)
            raise
        if ctl_id is None:  # the owner forgot it since
            store.ear.drop(self)
            return None
        self._seen = asyncio.get_running_loop().time()
        self._claim = ctl_id.decode() if isinstance(ctl_id, bytes) else str(ctl_id)
        channel.attach(follower)
        if channel.ended:
            store.ear.drop(self)
        else:
            store.ear.listen(self, {log: last_id, self._key("ctl"): ctl_id})
        return follower

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """Follow the log and the control stream until the stream ends or this client
        is replaced, stopped or gone."""
        channel = self._channel
        if channel is None:
            return False
        waiting = self._caught_up is not None
        if channel.follower is None and not waiting:
            return False
        if key == self._key("log"):
            going = self._record(channel, fields)
            if waiting and (channel.count >= self._after or channel.ended):
                caught_up = self._caught_up
                if caught_up is not None and not caught_up.done():
                    caught_up.set_result(None)
            return going or waiting
        op = text(fields, b"op")
        if op == "cancel":
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.CANCELLED))
            return False
        if op == "attach" and text(fields, b"f") != self._fid:
            renewed = text(fields, b"c")  # (a claim said again: judged at its first place)
            if renewed is not None and entry_order(renewed) < entry_order(self._claim):
                return True  # older than this client's: it ends nobody
            channel.attach_remote()  # a newer client, elsewhere: this one ends
            return False
        return True

    async def tick(self) -> bool:
        """Hold this client's lease (again, if Redis lost it: the owner is told once
        more); end if the owner is gone, or Redis has not answered for a lease period."""
        channel, store = self._channel, self._store
        if channel is None or channel.follower is None:
            return self._starting
        loop = asyncio.get_running_loop()
        lease_ms = store.lease_ms

        async def renew(client: Redis) -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(self._key("lease"), self._fid, px=lease_ms, get=True)
                pipe.exists(self._key("meta"))
                pipe.exists(store.settling)
                pipe.exists(store.epoch)
                results: list[Any] = await pipe.execute()
                return results

        try:
            results = await store.command(renew, upkeep=True)
        except StoreUnreachable:
            if loop.time() - self._seen > lease_ms / 1000:
                channel.end(tether.Aborted(channel.rid, tether.AbortReason.SERVER, _UNREACHABLE))
                return False
            return True
        self._seen = loop.time()
        held, alive = results[0], results[1]
        if held is None:
            # The lease was lost (Redis restarted) or lapsed: the owner may have parked
            # the stream meanwhile. Tell it this client is still here, even if Redis
            # lacks the stream now (this SET made the lease again: the next tick would
            # find it held, and the owner, until it publishes again, cannot be told).
            self._announce = True
        if not alive:
            # A live owner publishes it again within a block period or two of the loss;
            # one that has not after a settling period and a lease is gone, whatever
            # Redis says of its evictions (on one that evicts all the time it always
            # says "lately").
            missing = self._missing = self._seen if self._missing is None else self._missing
            if self._seen - missing <= (store.settle_ms + lease_ms) / 1000:
                try:
                    if await self._held() or not await store.absent(results):
                        return True  # Redis lost part of it, or evicts: it is published again
                except StoreUnreachable:
                    return True  # (asked again at the next tick)
            # The owner is gone (its keys expired): nobody will write more.
            gone = "the worker that ran this request is gone"
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.SERVER, gone))
            return False
        self._missing = None
        if self._announce:  # (again at the next tick if its control stream is not back)
            # Its claim renewed, at its place: a newer client's stays.
            fields = {"op": "attach", "w": store.worker, "f": self._fid, "c": self._claim}
            self._announce = not await self._send(fields)
        return True

    async def _held(self) -> bool:
        """Whether Redis still holds the stream's log or control stream, though it lost
        its meta, for longer than a stream that ended lingers: a live stream Redis lost
        part of (the keys of an owner that died expire together), whether or not INFO
        may count evictions. Asked only then."""

        async def ttls(client: Redis) -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.pttl(self._key("log"))
                pipe.pttl(self._key("ctl"))
                ttls: list[int] = await pipe.execute()
                return ttls

        return lives(*await self._store.command(ttls, upkeep=True))

    def silent(self) -> bool:
        """Redis has been silent for a lease period: this client's lease cannot have
        been renewed (its owner parks the stream), so it ends (a 503 error event)."""
        channel = self._channel
        if channel is None or channel.follower is None:
            return self._starting
        if not channel.ended:  # (an ended one: its client reads what it holds)
            channel.end(tether.Aborted(channel.rid, tether.AbortReason.SERVER, _UNREACHABLE))
        return False

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
        return self._tell(fields)

    def _record(self, channel: Channel, fields: Fields) -> bool:
        """One entry of the log; whether the stream goes on."""
        if channel.ended:
            return False
        if b"end" in fields:
            channel.end(end_error(channel.rid, fields))
            return False
        number = int(fields[b"n"])
        if number <= channel.count:  # the owner published its log again: had already
            return True
        if number != channel.count + 1:  # trimmed before it was read
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
        self._store.spawn(self._tell({"op": "cancel", "w": self._store.worker}))
        return True

    async def _tell(self, fields: dict[str, str]) -> None:
        """Tell the owner, as a task of the store's, trying again while Redis fails (a
        paused or restarting Redis comes back within a lease period more often than
        not, and an owner never told holds the stream for a client that left until
        this client's lease lapses): within that lease period, then given up, since
        the lapse tells the owner anyway."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self._store.lease_ms / 1000
        pause = _TELL_PAUSE
        while True:
            try:
                await self._post(fields)
                return
            except StoreUnreachable as exc:
                left = until - loop.time()
                if left <= pause:
                    logger.warning("resumable request: the owner could not be told (%s)", exc)
                    return
                if pause == _TELL_PAUSE:  # (once: the tries after it are told at the end)
                    logger.warning(
                        "resumable request: the owner could not be told (%s); trying again", exc
                    )
            await asyncio.sleep(pause)
            pause *= 2

    async def _send(self, fields: dict[str, str]) -> bool:
        """Tell the owner once (a Redis that fails is logged, not raised into nobody's
        hands); nothing once the owner's control stream is gone. Whether it was posted."""
        try:
            return await self._post(fields)
        except StoreUnreachable as exc:
            logger.warning("resumable request: the owner could not be told (%s)", exc)
            return False

    async def _post(self, fields: dict[str, str]) -> bool:
        """Post ``fields`` to the owner's control stream; whether it was there.

        :raises StoreUnreachable: Redis failed, or did not answer in time.
        """

        async def post(client: Redis) -> Any:
            ctl, bounded = self._key("ctl"), CTL_MAXLEN
            return await client.xadd(ctl, fields, maxlen=bounded, nomkstream=True)  # type: ignore[arg-type]

        return await self._store.command(post, upkeep=True) is not None

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

    def respite(self, channel: Channel) -> float:
        return 0.0  # (a mirror is never parked: no store holds it)

    def detached(self, channel: Channel, follower: Follower) -> None:
        self._store.ear.drop(self)
        if self._closing:  # (close() told the owner)
            return
        fields = {"op": "detach", "w": self._store.worker, "f": self._fid, "pos": str(follower.pos)}
        self._store.spawn(self._tell(fields))


def end_error(rid: str, end: Fields) -> tether.TetherError | None:
    kind = end.get(b"end")
    if kind == b"ok":
        return None
    if kind == b"aborted":
        return tether.Aborted(rid, tether.AbortReason(text(end, b"reason") or "server"))
    return tether.Aborted(rid, tether.AbortReason.SERVER, text(end, b"m"))
