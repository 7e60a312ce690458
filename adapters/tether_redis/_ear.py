"""One blocking read per store: the Redis streams that every resumable stream of this
worker listens to (an owner's control stream, a mirror's log and control stream) are
read by a single ``XREAD BLOCK``, and their periodic upkeep (leases, expiries,
re-publishing what Redis lost) runs from the same task.

One blocked connection per stream would not scale: a worker with as many resumable
streams as its client has connections would have its writers fail. Several listeners
may follow one key (two reconnects racing on one worker), each from its own position:
the read starts at the earliest, and each entry reaches only the listeners that have
not had it and had every one before it. A listener that joins while the read is
blocked pokes the worker's wake stream, so that its first entries are not held up for
a whole block period. The read and the upkeep go on whatever Redis does (down, paused,
restarted empty), each bounded. A Redis user that may not block (no ``+@blocking``,
which ``XREAD`` needs) has the same streams polled instead (``XRANGE``, once per block
period): Stop and a mirror's events arrive a block period late at most, never not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Protocol

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError

__all__ = [
    "CTL_MAXLEN",
    "GONE_MS",
    "Ear",
    "Fields",
    "Listener",
    "StoreRefused",
    "StoreUnreachable",
    "entry_order",
    "lives",
    "text",
]

CTL_MAXLEN: Final = 256
"""Entries a control stream keeps (each a few bytes; the owner reads them at once):
every ``XADD`` to one is bounded by it, whoever posts."""

GONE_MS: Final = 1000
"""How long the keys of a stream that is resumable no more linger (for clients
elsewhere to read its end entry): a key that lives longer, its meta lost, is part of
a live stream."""


def lives(*ttls: int) -> bool:
    """Whether a stream whose meta Redis lost is live by its keys' expiries (the PTTLs
    of its log and its control stream): one of them outlives the :data:`GONE_MS` the
    keys of a stream that ended linger. A live stream with no event yet has a control
    stream but no log; one whose control stream Redis lost has its log."""
    return any(ttl > GONE_MS for ttl in ttls)


logger = logging.getLogger("tether.redis")

Fields = dict[bytes, bytes]


class StoreUnreachable(ConnectionError):
    """Redis did not answer within the store's bound, refused, or lost the state this
    answer depends on: the stream may exist (a 503 to retry, never a 404)."""


class StoreRefused(StoreUnreachable):
    """Redis answered, but refused a command to this store's ACL user (``NOPERM``): a
    misconfiguration, not an outage. A 503 for the request that needed it; an owner
    whose writes are refused keeps its streams resumable on its own worker only, and
    never marks Redis settling for them (other workers' answers stay right)."""


class Listener(Protocol):
    """Something that listens to some Redis streams through an :class:`Ear`."""

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """One entry of ``key``; whether to go on listening."""
        ...

    async def tick(self) -> bool:
        """Upkeep, once per block period (leases, expiries); whether to go on. Called
        even while Redis fails, so that a lease that cannot be seen lapses."""
        ...

    def silent(self) -> bool:
        """Redis has answered this worker nothing for a lease period (no lease can
        have been seen for as long); whether to go on."""
        ...


def entry_order(entry_id: Any) -> tuple[int, int]:
    """An entry id (``b"ms-seq"``) as something that compares as Redis orders them."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


class Ear:
    """The one reader of a store's listened streams.

    :param client: the store's Redis client.
    :param wake_key: this worker's wake stream (poked when a listener joins).
    :param block_ms: how long one ``XREAD`` blocks; also the upkeep period.
    :param timeout: seconds past ``block_ms`` after which a read counts as failed
        (a paused Redis answers nothing: the read must not wait for it for ever).
    :param spawn: runs a task the store owns (and cancels when it closes).
    :param upkeep: the store's own upkeep, run before the listeners' (bounded by it).
    :param failed: tells the store that a read failed.
    :param answered: tells the store that Redis answered a read.
    :param overdue: tells the store that a read's bound, due at the time it is given,
        fired (late, if the loop was held meanwhile).
    """

    __slots__ = (
        "_answered",
        "_block_ms",
        "_client",
        "_failed",
        "_joined",
        "_keys",
        "_listens",
        "_nudge",
        "_overdue",
        "_polling",
        "_read_again_at",
        "_spawn",
        "_task",
        "_timeout",
        "_upkeep_store",
        "_wake_id",
        "_wake_key",
        "poke",
    )

    def __init__(
        self,
        client: Redis,
        wake_key: str,
        block_ms: int,
        timeout: float,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        upkeep: Callable[[], Awaitable[None]],
        failed: Callable[[], None],
        answered: Callable[[], None],
        overdue: Callable[[float | None], None],
    ) -> None:
        self._client = client
        self._wake_key = wake_key
        self._block_ms = block_ms
        self._timeout = timeout
        self._spawn = spawn
        self._upkeep_store = upkeep
        self._failed = failed
        self._answered = answered
        self._overdue = overdue
        self._keys: dict[str, dict[Listener, Any]] = {}
        """Each key's listeners, each with the id of the last entry it had."""
        self._listens = 0
        self._joined: dict[Listener, int] = {}
        """The number of each listener's latest :meth:`listen` (an upkeep's verdict on
        a listener that listened again meanwhile is stale)."""
        self._wake_id: Any = "0-0"
        self._polling = False
        """This Redis user may not block (``XREAD`` refused): the keys are polled, and
        ``XREAD`` tried again once per lease period (three block periods)."""
        self._read_again_at = 0.0
        self._nudge = asyncio.Event()
        """Set when a listener joins: a poll waits no longer (the wake stream's role)."""
        self._task: asyncio.Task[None] | None = None
        self.poke: Callable[[], Coroutine[Any, Any, None]] | None = None
        """Pokes the wake stream (bounded by the store); set by the store."""

    @property
    def polling(self) -> bool:
        """This Redis user may not block: the keys are polled, once per block period."""
        return self._polling

    def listen(self, listener: Listener, keys: dict[str, Any]) -> None:
        """Deliver the entries of ``keys`` after the given ids to ``listener`` (a key it
        listens to already goes on from where it is)."""
        for key, last in keys.items():
            self._keys.setdefault(key, {}).setdefault(listener, last)
        self._listens += 1
        self._joined[listener] = self._listens
        self._nudge.set()
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run())
        elif self.poke is not None:  # the read in progress does not name these keys yet
            self._spawn(self.poke())

    def drop(self, listener: Listener) -> None:
        """Deliver nothing more to ``listener``."""
        self._joined.pop(listener, None)
        for key in [key for key, held in self._keys.items() if listener in held]:
            held = self._keys[key]
            del held[listener]
            if not held:
                del self._keys[key]

    def _listeners(self) -> list[Listener]:
        return list({id(one): one for held in self._keys.values() for one in held}.values())

    async def _run(self) -> None:
        failing = False
        upkept = -float("inf")  # (the first upkeep comes first)
        period = self._block_ms / 1000
        while self._keys:
            now = time.monotonic()
            if now - upkept >= period:
                upkept = now
                await self._upkeep()
            bound = asyncio.timeout(period + self._timeout)
            try:
                async with bound:
                    await self._read()
                self._answered()
                if failing:
                    logger.warning("resumable streams: Redis answers again")
                    # The upkeep at once, not a period later: an owner whose streams
                    # Redis lacks marks it settling before other workers stop being wary.
                    upkept = -float("inf")
                failing = False
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed()
                if isinstance(exc, TimeoutError):
                    self._overdue(bound.when())
                if not failing:
                    logger.warning("resumable streams: Redis failed (%r); retrying", exc)
                failing = True
            if failing:  # (a Redis that refuses at once must not make this spin)
                await asyncio.sleep(period)
            elif self._polling:  # (the next poll a block period on, or once one joins)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(period):
                        await self._nudge.wait()

    async def _read(self) -> None:
        streams = {self._wake_key: self._wake_id}
        for key, held in self._keys.items():
            streams[key] = min(held.values(), key=entry_order)
        answer: Any
        started = time.monotonic()
        if self._polling and started < self._read_again_at:
            answer = await self._poll(streams)
        else:
            try:
                answer = await self._client.xread(streams, block=self._block_ms)  # type: ignore[arg-type]
            except NoPermissionError as exc:
                if not self._polling:
                    logger.warning(
                        "resumable streams: this Redis user may not block (%s; ACL "
                        "+@blocking): its control streams and mirrored logs are polled once "
                        "per block period",
                        exc,
                    )
                self._polling = True
                self._read_again_at = started + 3 * self._block_ms / 1000
                answer = await self._poll(streams)
            else:
                if self._polling:
                    logger.info("resumable streams: this Redis user may block again")
                    self._polling = False
        for raw, entries in answer or ():
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key == self._wake_key:
                self._wake_id = entries[-1][0]
                continue
            start = entry_order(streams[key])
            for entry_id, fields in entries:
                order = entry_order(entry_id)
                for listener, last in list(self._keys.get(key, {}).items()):
                    now = self._keys.get(key)
                    if now is None or listener not in now or entry_order(last) >= order:
                        continue  # dropped meanwhile, or it had this one already
                    if entry_order(last) < start:
                        # It joined during this read, from before where the read began:
                        # this answer lacks what comes first (the next read starts at it).
                        continue
                    now[listener] = entry_id
                    try:
                        going = listener.heard(key, entry_id, fields)
                    except Exception:
                        # One stream's bug must not end the reading of every other one.
                        logger.exception("resumable streams: a listener failed; dropped")
                        going = False
                    if not going:
                        self.drop(listener)

    async def _poll(self, streams: dict[str, Any]) -> list[tuple[str, list[Any]]]:
        """What ``XREAD`` would answer at once (no ``BLOCK``), by one ``XRANGE`` a key
        after its position (exclusive, ``(id``, Redis 6.2: an idle stream's last entry
        must not cross the network every poll; what a listener had is skipped anyway)."""
        self._nudge.clear()
        async with self._client.pipeline(transaction=False) as pipe:
            for key, last in streams.items():
                after = last.decode() if isinstance(last, bytes) else str(last)
                pipe.xrange(key, min=f"({after}")
            results = await pipe.execute()
        return [(key, entries) for key, entries in zip(streams, results, strict=True) if entries]

    def silent(self) -> None:
        """Redis has answered nothing for a lease period: every listener judges now,
        not after this reader's own waits (a read, a pause, the upkeep, a renewal:
        timeouts in a row) have run out."""
        for listener in self._listeners():
            try:
                going = listener.silent()
            except Exception:
                # One stream's bug must not end the reading of every other one.
                logger.exception("resumable streams: a listener failed; dropped")
                going = False
            if not going:
                self.drop(listener)

    async def _upkeep(self) -> None:
        """The store's upkeep, then every listener's, at once (each bounded by the
        store): one slow tick must not hold up the others' leases."""
        try:
            await self._upkeep_store()
        except (RedisError, OSError, TimeoutError) as exc:
            logger.debug("resumable streams: upkeep failed (%r)", exc)
        listeners = self._listeners()
        joined = [self._joined.get(listener) for listener in listeners]
        results = await asyncio.gather(
            *(listener.tick() for listener in listeners), return_exceptions=True
        )
        for listener, result, when in zip(listeners, results, joined, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                if not isinstance(result, RedisError | OSError | TimeoutError):
                    # A listener's bug must not end the reading of every other one.
                    logger.error("resumable streams: an upkeep failed", exc_info=result)
            elif not result and self._joined.get(listener) == when:
                # (the ticks run together, the slowest sets the pace: one that listened
                # again meanwhile, a reconnect that just attached, goes on)
                self.drop(listener)


def text(fields: Fields, name: bytes) -> str | None:
    """The text of field ``name`` of an entry, or ``None`` if it has none."""
    value = fields.get(name)
    return None if value is None else value.decode()
