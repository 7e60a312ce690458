"""RedisStore: the logs of resumable streams in Redis, so that a reconnect continues
on any front worker.

The worker that owns a request (its producer delivers there) keeps the stream's
:class:`~tether.resume.Channel` in process, as :class:`~tether.resume.MemoryStore` does, and
copies every event to a Redis stream ``<prefix><token>:log`` (``XADD`` with the
event's number as its id, bounded by ``MAXLEN`` and by bytes), ending it with an end
entry. A reconnect on that same worker is served from process; on another worker,
from a local mirror channel (``_mirror``) fed with the backlog (``XRANGE``) and then
the live tail (``XREAD BLOCK``).

The workers speak through a second stream, ``<prefix><token>:ctl``: a client that
attaches (its *claim*: the newest wins, every other one ends), a client that leaves
(the owner parks the request and starts its grace period), and Stop (the owner aborts
at once; its store's one reader is blocked on that stream, so it hears it within a
round trip). However many streams a worker holds, it reads them all with one blocked
connection (``_ear``). Only the owner aborts, so ``on_abort`` runs exactly once. A
worker whose client is attached holds a lease (``<prefix><token>:lease``) that it
renews while it reads; a lease that lapses, or that cannot be seen for as long, is a
client gone, and the owner parks the request then. Newest means latest in the control
stream, the one order every worker reads: a claim is judged by its place there, never
by when a worker hears it (see :class:`_Writer`).

Redis is never trusted to be up, fast or to keep what it was told: every command goes
through :meth:`RedisStore.command`, bounded in time (``timeout``) and in concurrency
(``connections``, half for what requests wait on, half for the copies and upkeep), so
a down, paused or saturated Redis costs a request at most ``timeout`` and a 503. An
owner whose copy failed, or whose keys Redis lost (a restart with no persistence),
publishes its stream again from process once Redis answers; a Redis that came back
empty is marked ``settling`` for a few block periods, during which a stream it does
not know is a 503 to retry, not a 404. Every key expires.

Departures from the in-process store: a failure reaches a client on another worker
as a 503 with the failure's public message (the exception itself stays with the
owner), and a client on another worker that reads too slowly for the log's bounds
ends with an error instead of making the owner abort.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, TypeVar

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, RedisError, ResponseError, WatchError

import tether
import tether.resume
from tether.http import error_response
from tether.resume import Channel, Follower, new_token

from ._ear import (
    CTL_MAXLEN,
    GONE_MS,
    Ear,
    Fields,
    StoreRefused,
    StoreUnreachable,
    entry_order,
    lives,
    text,
)
from ._mirror import Mirror

__all__ = ["RedisStore", "StoreRefused", "StoreUnreachable"]


class _Contended(StoreUnreachable):
    """A write fenced by a transaction lost every try: the stream's keys changed under
    each (Redis answered every command; the store is not made wary by it)."""


logger = logging.getLogger("tether.redis")

T = TypeVar("T")

_DUMPS: Final = tether.SSE().dumps
_CLOSE_TIMEOUT: Final = 2.0
"""Seconds :meth:`RedisStore.aclose` gives the writers to put their end entries."""
_FENCE: Final = """
-- The commands in ARGV (after ARGV[1], each its number of words, then its words), run
-- only while KEYS[1], the stream's end mark, is absent and, unless ARGV[1] is '0', its
-- meta KEYS[2] exists; each one's answer, an error included.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
if ARGV[1] ~= '0' and redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
local answers, i = {}, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  answers[#answers + 1] = redis.pcall(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return answers
"""
"""An owner's writes, refused once its stream's goodbye landed, or (all but a
publication) once its meta is gone (see ``_Writer._fenced``)."""
_MISSING: Final = 0
"""What a fenced write answers when the stream's meta is gone (it ran nothing)."""
_EPOCH_MS: Final = 86_400_000
"""The life of the key that says Redis holds this prefix's state (renewed by every
store's upkeep, and by every miss that finds it): its absence is a Redis that lost
everything, new to tether, or unused for as long (see :meth:`RedisStore.absent`)."""


class RedisStore(tether.resume.MemoryStore):
    """Resumable streams recorded in Redis Streams as well as in this process.

    :param client: a ``redis.asyncio.Redis`` client that returns bytes (the default,
        ``decode_responses=False``), whose pool holds more than ``connections``
        connections (one more is the store's blocked read); the store does not close it.
    :param prefix: the prefix of every key the store writes.
    :param block: seconds one ``XREAD BLOCK`` waits; also how often leases and
        expiries are renewed and lost state is re-published (the same on every worker:
        one's settling period covers the others' upkeep only then).
    :param timeout: the most seconds one command may take, waiting for its turn
        included, before Redis counts as unreachable (a 503 for a reconnect or a Stop;
        a new stream is served resumable here only until Redis answers again).
    :param connections: the most commands in flight at once: half for those a request
        waits on (open, reconnect, Stop), half for the copies and the upkeep.
    :raises ValueError: a non-positive ``block`` or ``timeout``, fewer than 2
        ``connections``, or a client pool too small for them.
    """

    __slots__ = (
        "_answered_at",
        "_closing",
        "_evicted_at",
        "_evictions",
        "_known",
        "_mirrors",
        "_ok_since",
        "_stalled_at",
        "_unsettled",
        "_watch",
        "_writers",
        "block_ms",
        "client",
        "ear",
        "epoch",
        "fence",
        "lease_ms",
        "prefix",
        "request_slots",
        "script_again_at",
        "scripting",
        "settle_ms",
        "settling",
        "timeout",
        "upkeep_slots",
        "worker",
    )

    def __init__(
        self,
        client: Redis,
        *,
        prefix: str = "tether:resume:",
        block: float = 1.0,
        timeout: float = 1.0,
        connections: int = 8,
    ) -> None:
        super().__init__()
        if not block > 0:
            raise ValueError(f"block must be a positive number of seconds, got {block}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
        if isinstance(connections, bool) or not isinstance(connections, int) or connections < 2:
            raise ValueError(f"connections must be an integer of at least 2, got {connections!r}")
        pool_size = getattr(client.connection_pool, "max_connections", None)
        if isinstance(pool_size, int) and pool_size <= connections:
            raise ValueError(
                f"the client's pool holds {pool_size} connections: it needs more than "
                f"connections={connections} (one more for the store's blocked read); "
                "pass a larger max_connections to Redis() or a smaller connections"
            )
        self.client = client
        self.prefix = prefix
        self.block_ms = max(1, int(block * 1000))
        self.lease_ms = 3 * self.block_ms
        """How long a client's lease lasts unless renewed (every block period): a
        client elsewhere whose Redis is silent for as long ends, its owner parks."""
        self.timeout = timeout
        self.settle_ms = 3 * self.block_ms + int(timeout * 1000)
        """How long a Redis that came back empty is ``settling``: every owner has
        re-published its streams by then."""
        self.worker = new_token()
        """This store's id in control messages."""
        self.epoch = f"{prefix}epoch"
        self.fence = client.register_script(_FENCE)
        """Runs an owner's writes unless its stream's goodbye landed (one ``EVALSHA``)."""
        self.scripting = True
        """Whether this Redis user may run the fence (false once refused: ``-@scripting``;
        a transaction watching the mark instead, and the script tried again once per
        lease period: a user granted ``+@scripting`` since goes back to it)."""
        self.script_again_at = 0.0
        """When a store that may not run scripts tries one again."""
        self.settling = f"{prefix}settling"
        self._known = False  # whether this store saw Redis hold the epoch
        self._answered_at = -float("inf")  # when Redis last answered this store
        self._watch: tuple[asyncio.TimerHandle, float] | None = None
        """The timer that judges silence a lease period after the answer it names."""
        self._stalled_at = -float("inf")
        """When this store last saw the event loop held past a deadline of its own (a
        bound that fired late): answers may have come meanwhile, unheard."""
        self._unsettled = False  # what the last upkeep saw: Redis settling, or empty
        self._evictions: int | None = None  # Redis's count of evicted keys, last seen
        self._evicted_at = -float("inf")  # when this store last saw that count grow
        self._ok_since: float | None = -float("inf")
        """Since when every command of this store went through (``None``: the last one
        failed). Absence is claimed only after ``settle_ms`` of that: every owner that
        may hold a stream Redis lacks has marked Redis ``settling`` by then."""
        self._writers: dict[str, _Writer] = {}
        self._mirrors: weakref.WeakSet[Mirror] = weakref.WeakSet()
        """The clients here of streams owned elsewhere (ended when this store closes)."""
        self._closing = False  # aclose() began: a reconnect that completes after it ends
        self.request_slots = asyncio.Semaphore(connections // 2)
        self.upkeep_slots = asyncio.Semaphore(connections - connections // 2)
        self.ear = Ear(
            client,
            f"{prefix}{self.worker}:wake",
            self.block_ms,
            timeout,
            self.spawn,
            self._upkeep,
            self.failed,
            self.answered,
            self.overdue,
        )
        """The one reader of every control stream and mirrored log of this worker."""
        self.ear.poke = self._poke

    def key(self, token: str, kind: str) -> str:
        """The Redis key of ``token``'s ``log``, ``ctl``, ``meta``, ``lease`` or ``end``."""
        return f"{self.prefix}{token}:{kind}"

    async def command(
        self, job: Callable[[Redis], Awaitable[T]], *, upkeep: bool = False, own: bool = False
    ) -> T:
        """Run ``job`` (one command or one pipeline) on the client, bounded: it waits
        for one of the store's slots and completes within ``timeout`` seconds in all.

        :param upkeep: take a slot of the copies' and upkeep's half, not the requests'.
        :param own: take no slot: the store's reader runs it between two reads, in its
            own turn (so that copies in numbers cannot delay it); never from elsewhere.
        :raises StoreUnreachable: it failed, or the bound passed (the command is
            cancelled; redis-py drops the connection it was on).
        :raises StoreRefused: Redis refused it to this ACL user (it answered: this store
            is not made wary by it).
        """
        slots = (
            contextlib.nullcontext() if own else self.upkeep_slots if upkeep else self.request_slots
        )
        try:
            async with asyncio.timeout(self.timeout) as bound, slots:
                result = await job(self.client)
        except TimeoutError as exc:
            self.failed()
            self.overdue(bound.when())
            raise StoreUnreachable(f"Redis did not answer within {self.timeout:g} s") from exc
        except _Contended:
            self.answered()  # (Redis answered every command: it is no outage)
            raise
        except NoPermissionError as exc:
            self.answered()
            raise StoreRefused(
                f"Redis refused a command to this store's ACL user ({exc}); see the ACL "
                "that RedisStore needs in docs/resume.md"
            ) from exc
        except (RedisError, OSError) as exc:
            self.failed()
            if isinstance(exc, StoreUnreachable):
                raise
            raise StoreUnreachable(f"Redis cannot be reached: {exc!r}") from exc
        self.answered()
        return result

    def lost(self, pipe_results: list[Any]) -> bool:
        """Whether Redis may lack streams that live: the answers to ``EXISTS settling,
        EXISTS epoch`` (the last two of a pipeline) say it lost its state lately, or
        this worker saw it fail lately (streams opened meanwhile are being published)."""
        settling, epoch = pipe_results[-2:]
        return bool(settling) or not epoch or self.wary()

    def unsettled(self) -> bool:
        """Whether Redis may lack streams that live, as far as this store knows without
        asking (its last upkeep saw Redis settling or empty, it is :meth:`wary`, or it
        saw Redis evict keys lately)."""
        return self._unsettled or self.wary() or self._evicting()

    async def absent(self, pipe_results: list[Any]) -> bool:
        """Whether a stream that Redis does not hold (its meta is missing, or its log
        lacks the event asked for) is proven absent: a 404, not a 503 to retry. Not
        while Redis may lack it (:meth:`lost`), nor while Redis evicts keys: an owner
        publishes again what it lost only once it notices, a block period later, and
        the settling mark that would say so may be evicted too. Asked only on such a
        miss (``INFO stats``): a healthy path costs nothing more. A miss that finds no
        epoch marks Redis settling and sets it (:meth:`_mark_settling`: settling ends by
        itself, though no stream runs anywhere); one that finds it renews it.

        :raises StoreUnreachable: Redis cannot be reached.
        """
        if not pipe_results[-1]:
            # No epoch (a Redis new to tether, or one whose epoch expired while no
            # stream ran, or restarted empty): marked settling and given one, in one
            # step, by whoever finds it so; a 503 now, and a 404 once settling ends.
            if await self.command(self._mark_settling):
                self._republish()
            return False
        if self.lost(pipe_results):
            return False

        async def evictions(client: Redis) -> int | None:
            async with client.pipeline(transaction=False) as pipe:
                pipe.pexpire(self.epoch, _EPOCH_MS)  # (alive while misses come)
                pipe.info("stats")
                _, stats = await pipe.execute(raise_on_error=False)
            if isinstance(stats, ResponseError):  # (INFO denied or renamed away)
                return None
            count = stats.get("evicted_keys")
            return count if isinstance(count, int) else None

        count = await self.command(evictions)
        if count is not None and count != self._evictions:
            # Grown since this store last looked, or never looked at: it may be now.
            if count:
                self._evicted_at = asyncio.get_running_loop().time()
            self._evictions = count
        return not self._evicting()

    def _evicting(self) -> bool:
        """Whether this store saw Redis evict keys within a settling period."""
        return asyncio.get_running_loop().time() - self._evicted_at < self.settle_ms / 1000

    def wary(self) -> bool:
        """Whether Redis failed this store lately: it has not answered every command
        for ``settle_ms`` since (measured from when it answered again, not from when it
        last failed: an owner marks Redis ``settling`` only once it answers)."""
        since = self._ok_since
        return since is None or asyncio.get_running_loop().time() - since < self.settle_ms / 1000

    def failed(self) -> None:
        """Redis failed a command of this store (see :meth:`lost`)."""
        self._ok_since = None

    def answered(self) -> None:
        """Redis answered a command or a read of this store."""
        loop = asyncio.get_running_loop()
        self._answered_at = now = loop.time()
        if self._ok_since is None:
            self._ok_since = now
        if self._watch is None and not self._closing:
            self._watch = (loop.call_at(now + self.lease_ms / 1000, self._judge), now)

    def overdue(self, deadline: float | None) -> None:
        """A bound of this store's, due at ``deadline``, fired: if it fired late, the
        event loop was held (a blocking handler), and Redis may have answered meanwhile
        though nothing here heard it (the bound threw the answer away)."""
        now = asyncio.get_running_loop().time()
        if deadline is not None and now - deadline > self.block_ms / 10_000:
            self._stalled_at = now

    def _judge(self) -> None:
        """A lease period after an answer: if Redis said nothing since, no lease can
        have been seen for as long, on any worker. The clients here of streams owned
        elsewhere end, and the owner's streams whose client is elsewhere park, now:
        not once the reader's timeouts in a row (a read of ``block + timeout``, a
        block period, the upkeep, a renewal) have run out. Answers only move the clock;
        the timer looks at it once per lease period, so a healthy Redis costs one
        callback per lease period and no command.

        Silence is Redis's, not the loop's: if the loop was held since that answer (a
        bound fired late, this timer included), answers may have come and been thrown
        away unheard, and the verdict waits for one fresh command (bounded by
        ``timeout``) to go unanswered. One only: a loop that lags on does not put the
        verdict off for ever."""
        watch, self._watch = self._watch, None
        if watch is None or self._closing:
            return
        loop = asyncio.get_running_loop()
        heard, since = self._answered_at, watch[1]
        if heard > since:  # heard from since: judge a lease period after that
            self._watch = (loop.call_at(heard + self.lease_ms / 1000, self._judge), heard)
            return
        self.overdue(since + self.lease_ms / 1000)
        if self._stalled_at > since:
            self.spawn(self._ask_again(since))
            return
        self.ear.silent()  # (the next answer arms the timer again)

    async def _ask_again(self, since: float) -> None:
        """The verdict of :meth:`_judge` once the loop was held: Redis is silent if it
        does not answer a fresh ``PING`` either (an answer meanwhile arms the timer)."""

        async def ping(client: Redis) -> None:
            await client.ping()

        # In a slot of the upkeep's, not the reader's own turn: the reader may be blocked
        # on Redis right now, and one command more would break the bound of commands in
        # flight (``connections`` + the reader's one). Waiting for a slot counts against
        # the same ``timeout``, and an answer to a command holding one answers for Redis.
        with contextlib.suppress(StoreUnreachable):
            await self.command(ping, upkeep=True)
        if self._answered_at <= since and not self._closing:
            self.ear.silent()

    def respite(self, channel: Channel) -> float:
        """While Redis fails or settles, the client of a parked stream may be held off
        by 503s: its grace period runs on for a settling period more (the channel caps
        the total at one more grace period)."""
        writer = self._writers.get(channel.token)
        unpublished = writer is not None and (writer.failing or writer.dirty)
        # Silence counts as failure: the upkeep asks Redis something every block
        # period, so a Redis that said nothing for two is paused or gone (its commands
        # have not timed out yet).
        silent = asyncio.get_running_loop().time() - self._answered_at > 2 * self.block_ms / 1000
        return self.settle_ms / 1000 if unpublished or silent or self.wary() else 0.0

    async def _mark_settling(self, client: Redis) -> bool:
        """Redis holds no epoch: mark it settling, and then give it one (one
        transaction: a reader sees one or the other, never neither), so that settling
        ends by itself a settling period later, whether or not any stream runs. A store
        that never saw the epoch cannot tell a new Redis from one that came back empty
        under owners that have not noticed yet (their streams would be 404s until they
        do). Whether streams of this worker's may be gone (it saw the epoch before)."""
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(self.settling, "1", px=self.settle_ms)
            pipe.set(self.epoch, "1", nx=True, px=_EPOCH_MS)
            await pipe.execute()
        self._unsettled = True
        lost = self._known  # (only then can streams of this worker's be gone)
        self._known = True
        return lost

    def _republish(self) -> None:
        for writer in self._writers.values():
            writer.republish()

    async def _poke(self) -> None:
        async def poke(client: Redis) -> None:
            async with client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.ear_wake, {"w": "1"}, maxlen=16)
                pipe.pexpire(self.ear_wake, 60_000)  # (a key XADD just made has no expiry)
                await pipe.execute()

        try:
            await self.command(poke, upkeep=True)
        except StoreUnreachable:
            pass  # (the read will name the new keys after its block period anyway)

    @property
    def ear_wake(self) -> str:
        return f"{self.prefix}{self.worker}:wake"

    async def _upkeep(self) -> None:
        """Once per block period: say that Redis holds this prefix's state; a Redis
        that did not (it restarted empty) is marked ``settling`` while every owner
        publishes its streams again."""

        async def mark(client: Redis) -> bool:
            async with client.pipeline(transaction=False) as pipe:
                pipe.pexpire(self.epoch, _EPOCH_MS)
                pipe.pexpire(self.ear_wake, 60_000)
                pipe.exists(self.settling)
                held, _, settling = await pipe.execute()
            self._unsettled = not held or bool(settling)
            if held:
                self._known = True
                return False
            return await self._mark_settling(client)

        if await self.command(mark, own=True):
            self._republish()
        if any(writer.unpublished for writer in self._writers.values()):
            # Streams this worker could not publish (Redis was down or paused): until
            # they are, a stream Redis does not know may be one of them (a 503, not 404).
            async def settle(client: Redis) -> None:
                await client.set(self.settling, "1", px=self.settle_ms)

            await self.command(settle, own=True)
            self._unsettled = True

    # -- the owner's side ------------------------------------------------------------

    async def opened(self, follower: Follower) -> None:
        """Publish the token before its client sees it: a reconnect or a Stop on any
        worker finds it from then on. Waits at most ``timeout`` (a Redis that does not
        answer leaves the stream resumable here only until it does)."""
        channel = self.channel(follower.token)
        if channel is None:
            return
        writer = self._writer(channel)
        if writer is None:
            return
        try:
            async with asyncio.timeout(self.timeout):
                await writer.tried.wait()
        except TimeoutError:
            pass  # (the writer logged why, or will, and publishes once Redis answers)

    def _writer(self, channel: Channel) -> _Writer | None:
        """The writer of ``channel``, started at its first event (which may come while
        the channel is being opened, before ``open()`` returns: an eager task)."""
        writer = self._writers.get(channel.token)
        if writer is None and self.holds(channel):
            writer = self._writers[channel.token] = _Writer(self, channel)
            if channel.follower is not None:  # its first client: claimed before the task
                writer.attach_here()  # runs (an eager one publishes at once, the claim too)
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
        writer = self._writers.get(channel.token)
        if writer is None:
            self._writer(channel)  # (its first client: the writer starts with its claim)
        else:  # (a reconnect here: the clients elsewhere end)
            writer.attach_here()

    def detached(self, channel: Channel, follower: Follower) -> None:
        writer = self._writers.get(channel.token)
        if writer is not None:
            writer.left()

    def forget(self, channel: Channel) -> None:
        super().forget(channel)
        writer = self._writers.get(channel.token)
        if writer is not None:
            writer.forgotten()

    def done(self, writer: _Writer, token: str) -> None:
        """``writer`` is over (its channel was forgotten)."""
        if self._writers.get(token) is writer:
            del self._writers[token]

    # -- any worker ----------------------------------------------------------------------

    async def follow(self, token: str, after: int) -> Follower | None:
        """A new client of the stream of ``token``: from this process if it owns it,
        else from Redis.

        :raises StoreUnreachable: Redis cannot be reached, or lost its state lately
            (the stream may exist: the answer is a 503, not a 404).
        """
        if self.channel(token) is not None or not _plain(token):
            return await super().follow(token, after)
        if self._closing:
            raise StoreUnreachable("this worker is shutting down")
        mirror = Mirror(self, token, after)
        follower = await mirror.start()
        if follower is not None and self.closing():
            # The store closed while it started: it holds nothing after the close (its
            # client is told, the owner told that it left).
            farewell = mirror.close()
            if farewell is not None:  # (one timeout: a request waits on Redis no longer)
                with contextlib.suppress(StoreUnreachable, TimeoutError):
                    async with asyncio.timeout(self.timeout):
                        await farewell
            raise StoreUnreachable("this worker is shutting down")
        if follower is not None:
            self._mirrors.add(mirror)
        return follower

    def closing(self) -> bool:
        """Whether :meth:`aclose` began (a reconnect that completes after it ends)."""
        return self._closing

    async def aclose(self) -> None:
        """Abort every stream still running and let each writer put its end entry in
        Redis (bounded), so that clients on other workers are told; end every client
        here of a stream owned elsewhere (its owner parks it); then end every task."""
        self._closing = True
        if self._watch is not None:
            self._watch[0].cancel()
            self._watch = None
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

        :raises StoreUnreachable: Redis cannot be reached, or lost its state lately.
        """
        if self.channel(token) is not None or not _plain(token):
            return await super().cancel(token)

        async def post(client: Redis) -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.exists(self.key(token, "meta"))
                # (NOMKSTREAM: never a control stream with no expiry)
                pipe.xadd(
                    self.key(token, "ctl"),
                    {"op": "cancel", "w": self.worker},
                    maxlen=CTL_MAXLEN,
                    nomkstream=True,
                )
                pipe.pttl(self.key(token, "ctl"))
                pipe.pttl(self.key(token, "log"))
                pipe.exists(self.settling)
                pipe.exists(self.epoch)
                results: list[Any] = await pipe.execute()
                return results

        results = await self.command(post)
        meta, posted = results[:2]
        # A meta with no control stream, or a control stream or log that lives on with
        # no meta (not the second a stream that ended lingers), is a live stream Redis
        # lost part of (the keys of an owner that died expire together): Stop is a 503
        # until its owner publishes it again, or, posted, reaches it; INFO or not.
        live = lives(*results[2:4])
        if posted is not None and (meta or live):
            return True
        if meta or live or not await self.absent(results):
            raise StoreUnreachable("Redis lost its state lately; its owner re-publishes it")
        return False


def _place(entry_id: Any) -> str:
    """An entry id as text (Redis answers bytes)."""
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _reached(channel: Channel) -> int:
    """Where a client elsewhere that vanished (its lease lapsed, or cannot be seen) is
    taken to have read: it said nothing, and this process never knew how far it read
    (``channel.sent`` is its own client's, from before). What it had not read, the log
    in Redis holds, and its own worker bounded its lag; counted from the end, the
    stream parks for its grace period, never aborted for events it may have read."""
    return channel.count


def _keep_ms(channel: Channel) -> int:
    """How long the keys of a running stream live unless renewed: a stalled owner's
    lapse once its grace period (and a margin) passed."""
    return int((channel.grace + 60) * 1000)


def _plain(token: str) -> bool:
    """Whether ``token`` could be one (so that it may name a key)."""
    return bool(token) and len(token) <= 64 and token.replace("-", "").replace("_", "").isalnum()


class _Writer:
    """The owner's copy of one channel to Redis, and its watch over the control stream.

    All of one stream's Redis work runs in its task, one command at a time, so that its
    entries land in order. A copy that fails, or keys that Redis lost, make the writer
    *dirty*: it publishes the whole channel again (what this process holds) once Redis
    answers, and goes on from there.

    Claims (``attach`` entries) are judged by their place in the control stream, which
    every worker reads in the same order: a client elsewhere listens from its own claim
    on and ends at the next. A client here attaches before its claim is there: until
    this worker hears that claim back, every claim it hears is older and ends nobody
    (its client ends when it hears ours). A claim of a client that left before it was
    sent is never sent (it would end a newer client elsewhere), and a client elsewhere
    that was heard meanwhile takes the stream then. A claim said again (a publication
    after Redis lost it, a lease renewed after it lapsed) carries the place of the
    first (``c``): one older than the newest claim ends nobody.
    """

    __slots__ = (
        "_channel",
        "_claims",
        "_deferred",
        "_ended",
        "_forgotten",
        "_keys",
        "_latest",
        "_lease_seen",
        "_logged",
        "_mark",
        "_outbox",
        "_pending",
        "_remote",
        "_sizes",
        "_store",
        "_turn",
        "_unseen",
        "_unsent",
        "_wake",
        "dirty",
        "failing",
        "refused",
        "task",
        "tried",
    )

    def __init__(self, store: RedisStore, channel: Channel) -> None:
        self._store = store
        self._channel = channel
        self._keys = tuple(store.key(channel.token, kind) for kind in ("log", "ctl", "meta"))
        self._mark = store.key(channel.token, "end")
        """Set by the goodbye: from then on no write of this writer's changes anything."""
        self._outbox: list[tuple[str, dict[str, str]]] = []
        self._wake = asyncio.Event()
        self._ended = False
        self._forgotten = False
        self.failing = False
        """Its last try failed: Redis lacks this stream (or may) until the next works."""
        self.refused = False
        """Its last try was refused to this ACL user: a misconfiguration that lasts, not
        an outage (Redis is not marked settling for it; it resumes here only)."""
        self._remote: str | None = None  # the client attached on another worker, if any
        self._lease_seen = 0.0
        self._unseen: str | None = None
        """The client elsewhere that this worker stopped seeing because Redis did not
        answer it (not because its lease lapsed): taken back if its lease is found
        held once Redis answers (its worker, which Redis did answer, never lost it and
        tells nothing again)."""
        self._claims = 0  # how many clients attached here: the number of the last claim
        self._pending = 0
        """The number of the claim of the client here until this worker hears it back
        (0: none pending): every claim heard meanwhile is older."""
        self._unsent = False
        """The pending claim has not left this process yet (it can be withdrawn)."""
        self._latest: str | None = None
        """The place (entry id) of the newest claim heard, this worker's or another's."""
        self._deferred: tuple[str, str] | None = None
        """The newest client elsewhere (its id, its claim's place) heard while a claim
        was pending: the client if that claim is withdrawn."""
        self._sizes: collections.deque[tuple[int, int]] = collections.deque()
        """The number and size in bytes of each event the log in Redis holds."""
        self._logged = False  # its log exists in Redis (an event or the end went out)
        self.dirty = True
        """Redis may lack what this writer wrote (never published yet, a write failed,
        or Redis lost it): the whole channel is published again at the next try."""
        self.tried = asyncio.Event()
        """Set once the first publication was tried (whatever came of it)."""
        self._turn = asyncio.Lock()
        """Held by each of this writer's transactions (no ``+@scripting``): its copies
        and its renewal, on two connections, never abort each other's ``WATCH``."""
        self.task: asyncio.Task[None] | None = None

    @property
    def unpublished(self) -> bool:
        """Its client may hold its token while Redis lacks it (the first publication
        was tried and failed, or Redis lost it since): other workers must not call it
        unknown."""
        return not self.refused and (self.failing or (self.dirty and self.tried.is_set()))

    def _log_entry(self, n: int, output: Any) -> tuple[str, dict[str, str]]:
        return f"{n}-0", {"n": str(n), "d": _DUMPS(output).decode()}

    def put(self, outputs: list[Any]) -> None:
        if self.dirty:
            return  # (the next publication copies them from the channel)
        first = self._channel.count - len(outputs) + 1
        self._outbox.extend(self._log_entry(n, output) for n, output in enumerate(outputs, first))
        self._wake.set()

    def _end_entry(self) -> tuple[str, dict[str, str]]:
        error = self._channel.error
        if error is None:
            entry = {"end": "ok"}
        elif isinstance(error, tether.Aborted):
            entry = {"end": "aborted", "reason": error.reason.value}
        else:
            body = error_response(error).body  # what a client may see of it
            entry = {"end": "failed", "m": str(body["error"]["message"])}
        return f"{self._channel.count}-1", entry

    def end(self, error: tether.TetherError | None) -> None:
        self._ended = True
        if not self.dirty:
            self._outbox.append(self._end_entry())
        self._wake.set()

    def attach_here(self) -> None:
        """A client attached here: its claim goes out (that of a client it replaced, if
        not sent yet, never does)."""
        self._claims += 1
        self._pending = self._claims
        self._unsent = True
        self._unseen = None
        self._outbox = [entry for entry in self._outbox if entry[0] != "ctl"]
        if not self.dirty:  # (else the publication sends it)
            self._outbox.append(("ctl", self._claim()))
            self._wake.set()

    def _claim(self) -> dict[str, str]:
        return {"op": "attach", "w": self._store.worker, "g": str(self._pending)}

    def left(self) -> None:
        """The client here left: its claim, if not sent yet, is withdrawn."""
        if self._pending and self._unsent:
            self._outbox = [entry for entry in self._outbox if entry[0] != "ctl"]
            self._withdraw()

    def _withdraw(self) -> None:
        """No claim of this worker's is pending any more: a client elsewhere heard
        meanwhile is the newest after all."""
        self._pending = 0
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._attach_remote(*deferred)

    def _attach_remote(self, fid: str, place: str) -> None:
        self._latest = place
        self._remote = fid
        self._unseen = None
        self._lease_seen = asyncio.get_running_loop().time()
        self._channel.attach_remote()

    def _standing_claim(self) -> dict[str, str] | None:
        """What a publication says of the client here: its claim if this worker has not
        heard it yet (Redis may never have had it), else that claim renewed at its place
        (a client elsewhere that claimed since stays); nothing if it left (a pending
        claim is withdrawn: Redis may never have had it)."""
        if self._channel.follower is None:
            if self._pending:
                self._withdraw()
            return None
        if self._pending or self._latest is None:
            self._unsent = False
            return self._claim()
        return {"op": "attach", "w": self._store.worker, "c": self._latest}

    def forgotten(self) -> None:
        self._forgotten = True
        self._wake.set()

    def lost(self) -> None:
        """Redis lost some of this stream's keys (this writer found out): say so, and
        publish it again."""
        logger.warning("resumable request %r: Redis lost it; published again", self._channel.rid)
        self.republish()

    def republish(self) -> None:
        """Redis lost this stream's keys: publish it again."""
        self.dirty = True
        self._outbox = []
        self._wake.set()

    async def run(self) -> None:
        """Copy the events as they come and keep the keys alive; publish everything
        again whenever Redis may have lost some; once the channel is forgotten, let
        the keys go (soon, for clients elsewhere to read the end)."""
        store, channel = self._store, self._channel
        store.ear.listen(self, {self._keys[1]: "0-0"})
        try:
            while not self._forgotten:
                if self.dirty or self._outbox:
                    await self._try(self._publish if self.dirty else self._flush)
                    self.tried.set()
                if self._forgotten or (self._outbox and not self.dirty):
                    continue
                await self._sleep()  # (an event, the end; a retry period while dirty)
            await self._last_words()
            # Let the keys go; retried at each tick while Redis fails, until they would
            # have expired by themselves anyway.
            deadline = asyncio.get_running_loop().time() + _keep_ms(channel) / 1000
            while not await self._try(self._goodbye):
                if asyncio.get_running_loop().time() > deadline:
                    break
                await self._sleep()
        finally:
            store.done(self, channel.token)
            store.ear.drop(self)

    async def _last_words(self) -> None:
        """A stream forgotten before it ended (Stop, its grace period, shutdown) is
        aborted right after: its end comes a step later, through its pump. The goodbye
        waits for it (within ``timeout``), so that the clients elsewhere read why the
        stream ended (a Stop: ``cancelled``), not that its owner is gone."""
        if self._ended or self.dirty or self._store.closing():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._store.timeout):
                while not self._ended:
                    self._wake.clear()
                    await self._wake.wait()

    async def _sleep(self) -> None:
        """Wait for something to copy; while Redis fails, for one block period at most
        (the retry does not depend on anything else running)."""
        self._wake.clear()
        if not self.dirty and not self._forgotten:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._store.block_ms / 1000):
                await self._wake.wait()

    async def _try(self, step: Callable[[Redis], Awaitable[None]]) -> bool:
        """Run one step against Redis; whether it went through (a failure makes the
        writer dirty and is logged once per outage)."""
        try:
            await self._store.command(step, upkeep=True)
        except _Contended as exc:
            # Redis answered: another's writes raced this one's (its own never do). What
            # it copied may be missing: published again at the next try.
            self.dirty = True
            self._outbox = []
            logger.warning("resumable request %r: %s; published again", self._channel.rid, exc)
            return False
        except StoreUnreachable as exc:
            self.dirty = True
            self._outbox = []
            refused = isinstance(exc, StoreRefused)
            if not self.failing or refused != self.refused:
                logger.error(
                    "resumable request %r: writing to Redis failed (%s); it resumes on "
                    "this worker only until %s",
                    self._channel.rid,
                    exc,
                    "its ACL user may write" if refused else "Redis answers again",
                )
            self.failing = True
            # Refused (NOPERM): a misconfiguration that lasts, not an outage: Redis is
            # not marked settling for it (other workers' wrong tokens stay 404s).
            self.refused = refused
            return False
        if self.failing:
            logger.warning("resumable request %r: Redis holds it again", self._channel.rid)
        self.failing = self.refused = False
        return True

    def _keep(self) -> int:
        channel = self._channel
        if not channel.ended:
            return _keep_ms(channel)
        # The owner holds an ended stream until a grace period after its last client
        # left, however long that client stayed: so do the keys.
        return int(channel.grace * 1000) + 2 * self._store.block_ms

    async def _publish(self, client: Redis) -> None:
        """Publish the whole channel (as this process holds it): first its meta and
        control stream (a few bytes: a reconnect or a Stop finds it at once, and the
        retry that follows a timeout costs little), then the log in one transaction,
        so that a reader never sees half of it (one that came in between waits for it,
        as for any log that lags the owner)."""
        store, channel = self._store, self._channel
        log, ctl, meta = self._keys
        self._outbox = []

        def meta_first(pipe: Any) -> None:
            pipe.hset(
                meta,
                mapping={
                    "rid": channel.rid,
                    "w": store.worker,
                    "m": channel.max_events,
                    "b": channel.max_bytes or 0,
                },
            )
            # The control stream exists from now on (others post to it only if it does).
            pipe.xadd(ctl, {"op": "open", "w": store.worker}, maxlen=CTL_MAXLEN)
            claim = self._standing_claim()
            if claim is not None:
                pipe.xadd(ctl, claim, maxlen=CTL_MAXLEN)
            self._expire(pipe, self._keep())

        if await self._fenced(client, meta_first, publish=True) is None:
            return  # (its goodbye came first: nothing to publish)
        # The log as it stands now, end included or not (no await until it is queued).
        upto, ended = channel.count, channel.ended
        entries = [
            self._log_entry(n, output) for n, output in enumerate(channel.events, channel.first)
        ]
        self._sizes.clear()

        def whole_log(pipe: Any) -> None:
            pipe.delete(log)
            self._add(pipe, entries)
            if ended:
                entry_id, fields = self._end_entry()
                pipe.xadd(log, fields, id=entry_id)
            pipe.pexpire(log, self._keep())

        if not isinstance(await self._fenced(client, whole_log), list):
            return  # (its goodbye came first, or Redis lost the meta since: again)
        self._logged = bool(entries) or ended
        self.dirty = False
        # What came while that transaction was in flight (put() ignored it: dirty).
        if self._pending and self._unsent:
            self._outbox.append(("ctl", self._claim()))
        for n in range(max(upto + 1, channel.first), channel.count + 1):
            self._outbox.append(self._log_entry(n, channel.events[n - channel.first]))
        if channel.ended and not ended:
            self._outbox.append(self._end_entry())

    def _add(
        self, pipe: Any, entries: list[tuple[str, dict[str, str]]], *, held: bool = False
    ) -> None:
        """Queue ``entries`` of the log on ``pipe``, trimmed to the channel's bounds:
        ``max_events`` and, in bytes, ``max_bytes`` (what the in-process log keeps).

        :param held: the log exists in Redis: an entry added to one that Redis lost
            makes no new log (its answer is ``None``)."""
        channel = self._channel
        log = self._keys[0]
        sizes = self._sizes
        for entry_id, fields in entries:
            pipe.xadd(
                log,
                fields,
                id=entry_id,
                maxlen=channel.max_events + 1,
                approximate=False,
                nomkstream=held,
            )
            sizes.append((int(fields["n"]), len(fields["d"])))
        while len(sizes) > channel.max_events:
            sizes.popleft()
        budget = channel.max_bytes
        if budget is not None and sizes:
            total = sum(size for _, size in sizes)
            trimmed = False
            while total > budget and len(sizes) > 1:
                total -= sizes.popleft()[1]
                trimmed = True
            if trimmed:
                pipe.xtrim(log, minid=f"{sizes[0][0]}-0", approximate=False)

    def _expire(self, pipe: Any, ms: int) -> None:
        for key in self._keys:
            pipe.pexpire(key, ms)

    async def _flush(self, client: Redis, *, last: bool = False) -> None:
        """Copy what waits in the outbox.

        :param last: the stream is resumable no more: its end entry is worth a log of
            its own if Redis lost the log (the clients elsewhere read the end there).
        """
        outbox, self._outbox = self._outbox, []
        if not outbox:
            return
        log, ctl, _ = self._keys
        # A log that Redis lost (evicted) must not be made anew by these entries: it
        # would hold only the newest, and a reconnect from an earlier event would be a
        # 404 for as long as the stream lives (the upkeep sees a log, and publishes
        # nothing). Added only to a log that exists, they tell of the loss instead.
        held = self._logged and not last

        def copies(pipe: Any) -> None:
            events: list[tuple[str, dict[str, str]]] = []
            for entry_id, fields in outbox:
                if entry_id == "ctl":  # (the claim of the client here: sent from now on)
                    self._unsent = False
                    pipe.xadd(ctl, fields, maxlen=CTL_MAXLEN)
                elif "end" in fields:
                    self._add(pipe, events, held=held)
                    events = []
                    pipe.xadd(log, fields, id=entry_id, nomkstream=held)
                else:
                    events.append((entry_id, fields))
            self._add(pipe, events, held=held)
            # A key that XADD just made has no expiry: set it in the same round trip, so
            # that an owner killed before its first upkeep leaves nothing for ever.
            self._expire(pipe, self._keep())

        # The goodbye's last copy needs no meta (Redis may have evicted it alone): it is
        # sent before the goodbye's mark, on the same connection, so never late.
        results = await self._fenced(client, copies, publish=last)
        if results is None:
            return  # (its goodbye came first)
        if results is False:  # (Redis lost its meta: these copies ran nowhere)
            self.lost()
            return
        if any(entry_id != "ctl" for entry_id, _ in outbox):
            self._logged = True
        if held and None in results:  # (only an entry added to no log answers None)
            self.lost()

    async def _goodbye(self, client: Redis) -> None:
        """The stream is resumable no more: what is left to copy (its end entry, for
        clients elsewhere), then its keys go soon, its meta at once."""
        if not self.dirty:
            await self._flush(client, last=True)
        async with client.pipeline(transaction=False) as pipe:
            # Marked first, for as long as any write of this writer's keeps the keys: one
            # still on its way (sent before, received after) changes nothing (_fenced).
            pipe.set(self._mark, "1", px=max(_keep_ms(self._channel), self._keep()))
            self._expire(pipe, GONE_MS)
            pipe.delete(self._keys[2])  # resumable nowhere from now on
            await pipe.execute()

    async def _fenced(
        self, client: Redis, fill: Callable[[Any], None], *, publish: bool = False
    ) -> list[Any] | Literal[False] | None:
        """Run the commands ``fill`` queues (on a pipeline never sent) at once, unless
        this stream's goodbye has landed, or (unless ``publish``) its meta is gone. A
        write of this writer's that Redis receives after its goodbye (a renewal, a copy
        or a publication sent before it, slow to arrive, or given up on here on a
        timeout and read by Redis after all) must not make the keys of a stream that
        ended live again; nor, once Redis evicted the goodbye's mark, may a renewal or a
        copy: the goodbye deleted the meta, and only a publication makes one.

        One script (``EVALSHA``); if this Redis user may not run scripts (no
        ``+@scripting``), a transaction watching the mark and the meta instead, one at
        a time per stream (the script is tried again once per lease period).

        :param publish: run whether or not the meta exists: a publication's first step
            (it makes the meta), or the goodbye's last copy (sent before its own mark,
            on the same connection: never late).
        :returns: each command's answer; ``None`` if the goodbye landed first;
            ``False`` if the meta is gone (Redis lost it, or the goodbye deleted it).
        :raises ResponseError: a command failed (the others ran).
        """
        pipe = client.pipeline(transaction=False)
        fill(pipe)
        store = self._store
        answers: Any = None
        scripted = store.scripting
        if not scripted:
            now = asyncio.get_running_loop().time()
            if now >= store.script_again_at:
                store.script_again_at = now + store.lease_ms / 1000
                scripted = True  # (granted +@scripting since? one try)
        if scripted:
            words: list[Any] = ["0" if publish else "1"]
            for args, _ in pipe.command_stack:
                words += [len(args), *args]
            try:
                answers = await store.fence(
                    keys=[self._mark, self._keys[2]], args=words, client=client
                )
            except NoPermissionError:
                if store.scripting:  # (once: writes of other streams may race here)
                    logger.warning(
                        "RedisStore: this Redis user may not run scripts (ACL +@scripting): "
                        "every write of an owner's costs a transaction watching its stream's "
                        "mark (3 or 4 round trips instead of 1)"
                    )
                    store.script_again_at = (
                        asyncio.get_running_loop().time() + store.lease_ms / 1000
                    )
                store.scripting = False
                scripted = False
            else:
                if not store.scripting:
                    logger.info("RedisStore: this Redis user may run scripts again")
                    store.scripting = True
        if not scripted:
            async with self._turn:
                answers = await self._watched(client, pipe.command_stack, publish=publish)
        if answers is None or answers == _MISSING:
            return None if answers is None else False
        for answer in answers:
            if isinstance(answer, ResponseError):
                raise answer
        return list(answers)

    async def _watched(
        self, client: Redis, stack: list[Any], *, publish: bool
    ) -> list[Any] | int | None:
        """The fence without a script: ``WATCH`` the mark and the meta, read them, then
        run the commands in ``MULTI``/``EXEC`` (which does nothing if either changed
        meanwhile: read again). Only another's write aborts it (this writer's own run
        one at a time): 8 aborted tries in a row are contention, not Redis failing."""
        mark, meta = self._mark, self._keys[2]
        async with client.pipeline(transaction=True) as pipe:
            for _ in range(8):
                try:
                    await pipe.watch(mark, meta)
                    if await pipe.exists(mark):
                        return None
                    if not publish and not await pipe.exists(meta):
                        return _MISSING
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for args, options in stack:
                        pipe.execute_command(*args, **options)
                    answers: list[Any] = await pipe.execute(raise_on_error=False)
                except WatchError:
                    continue
                return answers
        raise _Contended("the stream's keys changed under every try of a write")

    def heard(self, key: str, entry_id: Any, fields: Fields) -> bool:
        """The owner's ear: clients attaching and leaving elsewhere, Stop."""
        op, who = text(fields, b"op"), text(fields, b"w")
        if op == "cancel":
            self._stop()
        elif op == "attach" and who == self._store.worker:
            if b"c" not in fields:  # (a claim renewed says nothing new here)
                self._heard_mine(_place(entry_id), text(fields, b"g"))
        elif op == "attach":
            fid, renewed = text(fields, b"f"), text(fields, b"c")
            if fid is not None:
                self._heard_claim(fid, renewed or _place(entry_id), renewed=renewed is not None)
        elif op == "detach" and who != self._store.worker:
            fid = text(fields, b"f")
            if self._deferred is not None and self._deferred[0] == fid:
                self._deferred = None
            if fid == self._unseen:
                self._unseen = None
            if self._remote is not None and fid == self._remote:
                self._remote = None
                self._channel.detach_remote(int(text(fields, b"pos") or 0))
        return True

    def _heard_mine(self, place: str, number: str | None) -> None:
        """A claim of this worker's: every client elsewhere heard before it ends."""
        self._latest = place
        if number == str(self._pending):
            self._pending = 0
        self._deferred = self._unseen = None
        if self._remote is not None:  # (the stream parks if its client here left)
            self._remote = None
            self._channel.detach_remote(self._channel.sent)

    def _heard_claim(self, fid: str, place: str, *, renewed: bool) -> None:
        """A claim from elsewhere, made at ``place`` (heard in the stream's order, unless
        ``renewed``): the newest (its client takes the stream), or older than one this
        worker made or heard (it ends nobody)."""
        if self._pending:
            deferred = self._deferred
            if deferred is None or entry_order(place) > entry_order(deferred[1]):
                self._deferred = (fid, place)
        elif not renewed or self._latest is None or entry_order(place) >= entry_order(self._latest):
            self._attach_remote(fid, place)

    async def tick(self) -> bool:
        """Renew the keys (and notice that Redis lost them: publish again); a client
        elsewhere whose lease lapsed, or could not be seen for as long, is gone."""
        store, channel = self._store, self._channel
        if self._forgotten or self.dirty:
            self._wake.set()  # (the task retries its goodbye or its publication)
            if self._forgotten:
                return True
        lease = store.key(channel.token, "lease")
        remote = self._remote
        loop = asyncio.get_running_loop()

        logged, published = self._logged, not self.dirty  # (before the renewal is sent)

        def renewal(pipe: Any) -> None:
            pipe.exists(lease)
            self._expire(pipe, self._keep())

        async def renew(client: Redis) -> list[Any] | Literal[False] | None:
            return await self._fenced(client, renewal)

        try:
            answers = await store.command(renew, upkeep=True)
        except StoreUnreachable:
            answers = None
        else:
            if answers is None:  # (its goodbye came first: the stream is over)
                return True
            if answers is False:  # (Redis lost its meta: nothing renewed)
                if published and not self.dirty:
                    self.lost()
                return True
        results = answers
        # (the renewal's answers: its log, control stream and meta still exist; a log
        # exists once an event or the end was written, before the renewal was sent)
        if results is not None and published and not self.dirty:
            log_held = results[1] or not logged
            if not (log_held and results[2] and results[3]):
                self.lost()  # (Redis restarted empty, or evicted some of its keys)
        if remote is not None and remote == self._remote:
            if results is not None and results[0]:
                self._lease_seen = loop.time()
            elif results is not None:
                self._remote = None  # the worker of that client is gone
                channel.detach_remote(_reached(channel))
            elif loop.time() - self._lease_seen > store.lease_ms / 1000:
                self._unseen_remote()  # (or this worker cannot reach Redis)
        elif results is not None and self._unseen is not None and self._remote is None:
            unseen, self._unseen = self._unseen, None
            if results[0] and channel.follower is None and not self._pending:
                # Its lease is held: that client was there all along.
                self._attach_remote(unseen, self._latest or "0-0")
        return True

    def silent(self) -> bool:
        """Redis has been silent for a lease period: a client elsewhere cannot have
        renewed its lease in that time (its worker ends it), so the stream parks."""
        self._unseen_remote()
        return True

    def _unseen_remote(self) -> None:
        """The client elsewhere cannot be seen (Redis does not answer this worker): the
        stream parks, until its lease is found held again (see ``_unseen``)."""
        if self._remote is not None:
            self._unseen, self._remote = self._remote, None
            self._channel.detach_remote(_reached(self._channel))

    def _stop(self) -> None:
        """Stop, from any worker: abort at once, and forget."""
        channel = self._channel
        self._store.forget(channel)
        if not channel.ended:
            channel.abort(tether.AbortReason.CANCELLED)
        follower = channel.follower
        if follower is not None:
            follower.detach(tether.AbortReason.CANCELLED)
