"""The in-process log of a resumable stream, its followers, and the store that owns
both (see ``_resume`` for the concept).

A pump task per stream reads it into a :class:`_Channel`'s list of outputs,
numbered from 1; a :class:`Follower` hands one client the events after its
position, then waits on the channel for more. One follower is attached at a time
(the newest); while none is, a timer of ``grace`` seconds runs, and when it fires
the stream is aborted (live) or forgotten (ended).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
from typing import Any, Final

from ._errors import Aborted, AbortReason, TetherError
from ._scope import current_scope
from ._stream import Stream

__all__ = ["Follower", "MemoryStore"]

logger = logging.getLogger("tether")

_TOKEN_BYTES: Final = 16
"""128 random bits per resume token."""

_PARKED: Final = (AbortReason.CLIENT_DISCONNECTED, AbortReason.CANCELLED)
"""What a follower's cancel means when it only detaches its client."""


class _Channel:
    """One resumable stream's log of events, in one process."""

    __slots__ = (
        "count",
        "ended",
        "error",
        "events",
        "first",
        "follower",
        "grace",
        "max_events",
        "rid",
        "sent",
        "store",
        "stream",
        "timer",
        "token",
        "waiter",
    )

    def __init__(self, store: MemoryStore, stream: Stream, grace: float, max_events: int) -> None:
        self.store = store
        self.stream = stream
        self.rid = stream.rid
        self.token = secrets.token_urlsafe(_TOKEN_BYTES)
        self.grace = grace
        self.max_events = max_events
        self.events: list[Any] = []
        self.first = 1  # the number of events[0]
        self.count = 0  # the number of the last event recorded
        self.sent = 0  # the last event handed to a client that since detached
        self.ended = False
        self.error: TetherError | None = None
        self.follower: Follower | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def append(self, outputs: list[Any]) -> None:
        """Record outputs the pump read; abort the request if too many wait unsent."""
        events = self.events
        events.extend(outputs)
        self.count += len(outputs)
        follower = self.follower
        sent = follower.pos if follower is not None else self.sent
        if self.count - sent > self.max_events:
            logger.warning(
                "resumable request %r: more than %d events wait for a client; aborted",
                self.rid,
                self.max_events,
            )
            self.stream.cancel(AbortReason.CONSUMER_TOO_SLOW)
        # Forget what was sent beyond the cap, in steps so that it costs O(1) per event.
        extra = len(events) - self.max_events
        if extra > self.max_events // 2:
            drop = min(extra, sent - self.first + 1)
            if drop > 0:
                del events[:drop]
                self.first += drop
        self.wake()

    def end(self, error: TetherError | None) -> None:
        """The stream ended: finished (``None``), failed, or aborted (then forgotten)."""
        self.ended = True
        self.error = error
        if isinstance(error, Aborted):
            self.store.forget(self)  # an aborted stream is not resumable
        elif self.follower is None:
            self.arm()
        self.wake()

    def attach(self, follower: Follower) -> None:
        old = self.follower
        self.follower = follower
        self.disarm()
        if old is not None:
            old.replaced()
            self.wake()

    def detach(self, follower: Follower) -> None:
        if self.follower is not follower:
            return
        self.follower = None
        self.sent = follower.pos
        self.wake()
        if self.store.holds(self):
            self.arm()

    def arm(self) -> None:
        self.disarm()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.grace, self.expire)

    def disarm(self) -> None:
        timer = self.timer
        if timer is not None:
            self.timer = None
            timer.cancel()

    def expire(self) -> None:
        """The grace period passed with no client: abort a live stream, forget its log."""
        self.timer = None
        if self.follower is not None:
            return
        self.store.forget(self)
        if not self.ended:
            self.stream.cancel(AbortReason.CLIENT_DISCONNECTED)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def pump(self) -> None:
        """Read the stream into the log until it ends, whoever is attached."""
        stream = self.stream
        try:
            while (outputs := await stream.next_ready()) is not None:
                self.append(outputs)
        except TetherError as exc:
            self.end(exc)
        except asyncio.CancelledError:  # the store is closing: the stream was aborted
            self.end(Aborted(self.rid, AbortReason.SERVER, "the server is shutting down"))
            raise
        else:
            self.end(None)
        finally:
            await stream.aclose()


class Follower:
    """One client's view of a resumable stream: what an :class:`~tether.http.Exchange`
    reads instead of the stream. Its outputs come as ``(event id, output)`` pairs.

    Its scope cancelling it (the client left, the request ended) only detaches it;
    cancelling it for another reason (an output it cannot encode) aborts the request.
    """

    __slots__ = ("_channel", "_closed", "_gone", "pos")

    def __init__(self, channel: _Channel, after: int) -> None:
        self._channel = channel
        self.pos = after
        """The number of the last event handed out."""
        self._closed = False
        self._gone: Aborted | None = None

    @property
    def rid(self) -> str:
        """The request id of the stream followed."""
        return self._channel.rid

    @property
    def token(self) -> str:
        """The stream's resume token."""
        return self._channel.token

    def __repr__(self) -> str:
        return f"<Follower {self._channel.rid!r} at={self.pos}>"

    @property
    def finished(self) -> bool:
        """Whether this client is done with the stream (nothing for a scope to cancel)."""
        return self._closed or self._gone is not None

    @property
    def exhausted(self) -> bool:
        """Whether everything was handed out and the stream ended cleanly."""
        channel = self._channel
        return (
            self._gone is None
            and channel.ended
            and channel.error is None
            and self.pos >= channel.count
        )

    def replaced(self) -> None:
        """A newer reconnect took this stream over: this client ends quietly."""
        if self._gone is None:
            self._gone = Aborted(self.rid, AbortReason.CLIENT_DISCONNECTED, "resumed elsewhere")

    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """Detach this client (``client_disconnected``, ``cancelled``: the stream is
        parked); any other reason aborts the request.

        :returns: whether a request was aborted.
        """
        channel = self._channel
        if reason not in _PARKED:
            return channel.stream.cancel(reason)
        if self._gone is None:
            self._gone = Aborted(self.rid, reason)
            channel.detach(self)
        return False

    async def result(self) -> Any:
        """A resumable stream is only streamed.

        :raises TypeError: always.
        """
        raise TypeError("a resumable stream is only streamed: it has no result()")

    def abort(self) -> bool:
        """Abort the request followed (the response could not even start)."""
        return self._channel.stream.cancel(AbortReason.CANCELLED)

    async def aclose(self) -> None:
        """Detach this client; the stream goes on (parked) for the grace period."""
        self._closed = True
        self.cancel(AbortReason.CANCELLED)

    def ready(self) -> list[tuple[str, Any]] | None:
        """Every event not handed out yet, as ``(event id, output)`` pairs.

        :returns: a non-empty list; ``[]`` when nothing is ready; ``None`` at the end.
        :raises TetherError: the stream failed or was aborted, or this client left.
        """
        if self._closed:
            return None
        if self._gone is not None:
            raise self._gone.with_traceback(None)
        channel = self._channel
        pos, count = self.pos, channel.count
        if pos < count:
            self.pos = count
            prefix = channel.token + "."
            start = pos + 1
            events = channel.events[start - channel.first :]
            return [(prefix + str(n), output) for n, output in enumerate(events, start)]
        if channel.error is not None:
            raise channel.error.with_traceback(None)
        return None if channel.ended else []

    async def wait_ready(self, *, timeout: float | None = None) -> None:
        """Wait until :meth:`ready` has something to say, or ``timeout`` passed."""
        channel = self._channel
        if (
            self._closed
            or self._gone is not None
            or self.pos < channel.count
            or channel.ended
            or channel.follower is not self
        ):
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        channel.waiter = waiter
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if channel.waiter is waiter:
                channel.waiter = None
            scope = current_scope()
            if scope is not None:
                scope.cancelled()  # the framework may be cancelling because the client left
            self.cancel(AbortReason.CANCELLED)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def next_ready(self, *, timeout: float | None = None) -> list[Any] | None:
        """Every event ready, waiting for one (up to ``timeout``, then ``[]``)."""
        items = self.ready()
        while items == []:
            await self.wait_ready(timeout=timeout)
            items = self.ready()
            if timeout is not None:
                break
        return items


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class MemoryStore:
    """The logs of resumable streams in this process (the default store).

    Owns the pump task of each stream it holds; :meth:`aclose` cancels and awaits them.
    """

    __slots__ = ("_channels", "_tasks")

    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """How many streams are resumable now."""
        return len(self._channels)

    @property
    def parked(self) -> int:
        """How many of them have no client now (each waits out its grace period)."""
        return sum(channel.follower is None for channel in self._channels.values())

    def open(self, stream: Stream, grace: float, max_events: int) -> Follower:
        """Start recording ``stream``; the follower of its first client."""
        channel = _Channel(self, stream, grace, max_events)
        self._channels[channel.token] = channel
        follower = Follower(channel, 0)
        channel.attach(follower)
        # A context of its own: the pump belongs to no HTTP request's scope.
        task = asyncio.get_running_loop().create_task(channel.pump(), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return follower

    def follow(self, token: str, after: int) -> Follower | None:
        """A new client of the stream of ``token`` after event ``after``, or ``None``."""
        channel = self._channels.get(token) if token else None
        if channel is None or not channel.first - 1 <= after <= channel.count:
            return None
        follower = Follower(channel, after)
        channel.attach(follower)
        return follower

    def cancel(self, token: str) -> bool:
        """Abort the stream of ``token`` now and forget it; whether it was known."""
        channel = self._channels.get(token) if token else None
        if channel is None:
            return False
        self.forget(channel)
        if not channel.ended:
            channel.stream.cancel(AbortReason.CANCELLED)
        follower = channel.follower
        if follower is not None:
            follower.cancel(AbortReason.CANCELLED)
        return True

    def holds(self, channel: _Channel) -> bool:
        return self._channels.get(channel.token) is channel

    def forget(self, channel: _Channel) -> None:
        if self._channels.get(channel.token) is channel:
            del self._channels[channel.token]
        channel.disarm()

    async def aclose(self) -> None:
        """Abort every stream still recorded and forget every log."""
        for channel in list(self._channels.values()):
            self.forget(channel)
            if not channel.ended:
                channel.stream.cancel(AbortReason.SERVER)
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
