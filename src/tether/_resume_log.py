"""A resumable stream's log in one process (:class:`Channel`) and one client's view of
it (:class:`Follower`); see ``_resume`` for the concept.

A channel holds the outputs numbered from 1 and at most one follower, the newest; a
follower hands its client the events after its position, then waits on the channel.
While no client is attached, a timer of ``grace`` seconds runs; when it fires the
stream is aborted (live) or forgotten (ended). A store (``_memory_store``) keeps
channels and hears what happens to them (:class:`Keeper`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ._errors import NOBODY_READS, Aborted, AbortReason, TetherError
from ._exchange import Numbered
from ._idle import IdleDeadline
from ._scope import waiter_cancelled
from ._weights import Weights

__all__ = ["Channel", "Follower", "Keeper"]

logger = logging.getLogger("tether")


class Keeper(Protocol):
    """What holds a :class:`Channel` (a store) and hears what happens to it."""

    def holds(self, channel: Channel) -> bool:
        """Whether ``channel`` is still resumable."""
        ...

    def forget(self, channel: Channel) -> None:
        """``channel`` is resumable no more."""
        ...

    def recorded(self, channel: Channel, outputs: list[Any]) -> None:
        """``outputs`` were appended to ``channel`` (numbered up to ``channel.count``)."""
        ...

    def ended(self, channel: Channel) -> None:
        """``channel``'s stream ended (``channel.error`` says how)."""
        ...

    def attached(self, channel: Channel, follower: Follower) -> None:
        """``follower`` is ``channel``'s client now."""
        ...

    def detached(self, channel: Channel, follower: Follower) -> None:
        """``follower``, ``channel``'s client, left after event ``follower.pos``."""
        ...

    def respite(self, channel: Channel) -> float:
        """Seconds more ``channel``'s grace period should run because its client may
        have been unable to come back (a shared store was unreachable); 0 for none."""
        ...


class Channel:
    """One resumable stream's log of events, in one process: the owner's record of
    it, or (a store shared between processes) a mirror of another process's.

    :param keeper: the store that holds it.
    :param rid: the request id.
    :param token: the resume token.
    :param grace: seconds it lives on with no client.
    :param max_events: how many events may wait for a client before ``abort``.
    :param abort: aborts the request with a reason (``on_abort`` exactly once).
    :param max_bytes: how many bytes of events (:func:`~tether.approximate_size`) may
        wait for a client before ``abort``, and are kept for a reconnect; ``None``: no
        byte budget (the events are not weighed).
    """

    __slots__ = (
        "abort",
        "count",
        "ended",
        "error",
        "events",
        "first",
        "follower",
        "grace",
        "held_over",
        "keeper",
        "max_bytes",
        "max_events",
        "remote",
        "rid",
        "sent",
        "timer",
        "token",
        "waiter",
        "weights",
    )

    def __init__(
        self,
        keeper: Keeper,
        rid: str,
        token: str,
        *,
        grace: float,
        max_events: int,
        abort: Callable[[AbortReason], bool],
        max_bytes: int | None = None,
    ) -> None:
        self.keeper = keeper
        self.abort = abort
        self.rid = rid
        self.token = token
        self.remote = False  # a client attached in another process (see attach_remote)
        self.grace = grace
        self.held_over = 0.0
        """Seconds this grace period was extended by its keeper's respites."""
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.weights = None if max_bytes is None else Weights(max_bytes)
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
        # (a client in another process reads from there: the cap is its store's to keep)
        sent = follower.pos if follower is not None else self.count if self.remote else self.sent
        weights = self.weights
        heavy = weights is not None and weights.add(outputs, self.count - sent)
        if heavy or self.count - sent > self.max_events:
            logger.warning(
                "resumable request %r: more than %s wait for a client; aborted",
                self.rid,
                f"{self.max_bytes} bytes of events" if heavy else f"{self.max_events} events",
            )
            self.abort(AbortReason.CONSUMER_TOO_SLOW)
        # Forget what was sent beyond the cap, in steps so that it costs O(1) per event.
        extra = len(events) - self.max_events
        if extra <= self.max_events // 2:
            extra = 0 if weights is None else weights.excess()  # (bytes, in steps too)
        self._drop(min(extra, sent - self.first + 1))
        self.keeper.recorded(self, outputs)
        self.wake()

    def preload(self, events: list[Any], first: int) -> None:
        """Start from ``events`` numbered from ``first``, read elsewhere (a mirror)."""
        self.events = events
        self.first = first
        self.count = first + len(events) - 1
        if self.weights is not None:
            self.weights.preload(events)

    def _drop(self, drop: int) -> None:
        """Forget the oldest ``drop`` events (sent ones: a reconnect asks no earlier)."""
        if drop > 0:
            del self.events[:drop]
            self.first += drop
            if self.weights is not None:
                self.weights.drop(drop)

    def end(self, error: TetherError | None) -> None:
        """The stream ended: finished (``None``), failed, or aborted (then forgotten)."""
        self.ended = True
        self.error = error
        self.keeper.ended(self)
        if isinstance(error, Aborted):
            self.keeper.forget(self)  # an aborted stream is not resumable
        elif self.follower is None and not self.remote:
            self.arm()
        self.wake()

    def attach(self, follower: Follower) -> None:
        """``follower`` is the client now: the one before it ends, the timer stops."""
        old = self.follower
        self.follower = follower
        self.remote = False
        self.disarm()
        if old is not None:
            old.replaced()
            self.wake()
        self.keeper.attached(self, follower)

    def attach_remote(self) -> None:
        """A client attached in another process: this one's ends, the timer stops."""
        old = self.follower
        self.follower = None
        self.remote = True
        self.disarm()
        if old is not None:
            old.replaced()
            self.wake()

    def detach_remote(self, sent: int) -> None:
        """The other process's client left after event ``sent``: the stream parks."""
        if self.remote:
            self.remote = False
            self.sent = max(self.sent, sent)
            if self.keeper.holds(self):
                self.arm()

    def detach(self, follower: Follower) -> None:
        """``follower`` left (if it still was the client): the stream parks."""
        if self.follower is not follower:
            return
        self.follower = None
        self.sent = follower.pos
        self.wake()
        if self.keeper.holds(self):
            self.arm()
        # Told last: it may hand the stream to a client of another process at once.
        self.keeper.detached(self, follower)

    def arm(self) -> None:
        """Start the grace period (again)."""
        self.disarm()
        self.held_over = 0.0
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.grace, self.expire)

    def disarm(self) -> None:
        """Stop the grace period."""
        timer = self.timer
        if timer is not None:
            self.timer = None
            timer.cancel()

    def expire(self) -> None:
        """The grace period passed with no client: abort a live stream, forget its log."""
        self.timer = None
        if self.follower is not None or self.remote:
            return
        # A client that could not come back (its store was down) gets the time it lost,
        # up to one more grace period: a store that never returns cannot keep it alive.
        more = min(self.keeper.respite(self), self.grace - self.held_over)
        if more > 0:
            self.held_over += more
            self.timer = asyncio.get_running_loop().call_later(more, self.expire)
            return
        self.keeper.forget(self)
        if not self.ended:
            self.abort(AbortReason.CLIENT_DISCONNECTED)

    def wake(self) -> None:
        """Wake the follower waiting for more, if one is."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


class Follower(Numbered):
    """One client's view of a resumable stream: what an :class:`~tether.http.Exchange`
    reads instead of the stream. Its outputs come as ``(event id, output)`` pairs.

    Its scope cancelling it (the client left, the request ended) only detaches it;
    cancelling it for another reason (an output it cannot encode) aborts the request.
    """

    __slots__ = ("_channel", "_closed", "_gone", "_idle", "pos")

    def __init__(self, channel: Channel, after: int) -> None:
        self._channel = channel
        self.pos = after
        """The number of the last event handed out."""
        self._closed = False
        self._gone: Aborted | None = None
        self._idle = IdleDeadline(self._on_idle)  # the keep-alive wait's, one timer

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
            self._idle.clear()  # (its timer would keep it until the next ping time)

    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """Abort the request followed, as a stream's ``cancel`` does.

        :returns: whether it was live.
        """
        return self._channel.abort(reason)

    def detach(self, reason: AbortReason = AbortReason.CLIENT_DISCONNECTED) -> bool:
        """Detach this client (``client_disconnected``, ``cancelled``: the stream is
        parked); any other reason aborts the request.

        :returns: whether a request was aborted.
        """
        channel = self._channel
        if reason not in NOBODY_READS:
            return channel.abort(reason)
        if self._gone is None:
            self._gone = Aborted(self.rid, reason)
            self._idle.clear()
            channel.detach(self)
        return False

    async def result(self) -> Any:
        """A resumable stream is only streamed.

        :raises TypeError: always.
        """
        raise TypeError("a resumable stream is only streamed: it has no result()")

    def abort(self) -> bool:
        """Abort the request followed (the response could not even start)."""
        return self._channel.abort(AbortReason.CANCELLED)

    async def aclose(self) -> None:
        """Detach this client; the stream goes on (parked) for the grace period."""
        self._closed = True
        self._idle.clear()
        self.detach(AbortReason.CANCELLED)

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
        self._idle.set(loop, timeout)
        try:
            await waiter
        except asyncio.CancelledError:
            if channel.waiter is waiter:
                channel.waiter = None
            waiter_cancelled()
            self.detach(AbortReason.CANCELLED)
            raise

    def _on_idle(self) -> None:
        """The wait's deadline passed: it ends (with nothing, the caller pings)."""
        channel = self._channel
        waiter = channel.waiter
        if waiter is not None and channel.follower is self:
            channel.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next_ready(self, *, timeout: float | None = None) -> list[Any] | None:
        """Every event ready, waiting for one (up to ``timeout``, then ``[]``)."""
        items = self.ready()
        while items == []:
            await self.wait_ready(timeout=timeout)
            items = self.ready()
            if timeout is not None:
                break
        return items
