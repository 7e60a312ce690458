"""RequestScope: the per-HTTP-request context that adapters open.

An adapter opens one scope around each HTTP request. Every ``Stream`` or
``Batch`` opened while it is current (a :mod:`contextvars` variable, so it
follows the handler into the tasks it starts) is tracked; :meth:`disconnect`
cancels them all at once when the client goes away, and cuts any wait of tether's
for the request that began before it had anything to track
(:meth:`~RequestScope.waiting`); leaving the scope closes whatever the handler
left open, so no path leaves a request behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Final, Protocol, Self

from ._errors import Aborted, AbortReason

__all__ = [
    "MAX_REQUEST_ID_LENGTH",
    "REQUEST_ID_HEADER",
    "RequestScope",
    "accept_request_id",
    "current_scope",
    "waiter_cancelled",
]

REQUEST_ID_HEADER: Final = "X-Request-Id"
"""The header a client may label its request with; adapters echo it back."""

MAX_REQUEST_ID_LENGTH: Final = 128
"""Longer ``X-Request-Id`` values are ignored."""

_PRINTABLE: Final = re.compile("[\x20-\x7e]+")

_PRUNE_FLOOR = 64
"""Below this many adopted consumers a scope never looks for finished ones."""

_current: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar(
    "tether_request_scope", default=None
)


_LEFT_WAITING: Final = "the client disconnected while the request waited"


class Tracked(Protocol):
    """What a scope needs of what it tracks (a ``Stream``, ``Batch`` or ``Follower``)."""

    @property
    def finished(self) -> bool:
        """Whether none of its requests is in flight any more."""
        ...

    def cancel(self, reason: AbortReason = ...) -> bool:
        """Abort whatever is unfinished; whether anything was."""
        ...


def _leave(consumer: Tracked, reason: AbortReason) -> bool:
    """The request of ``consumer`` is over for its client: a reader that can leave
    without ending the work (a resumable stream's follower) ``detach``es, any other
    is cancelled. Whether anything was aborted."""
    detach: Callable[[AbortReason], bool] | None = getattr(consumer, "detach", None)
    return (consumer.cancel if detach is None else detach)(reason)


def accept_request_id(value: str | bytes | None) -> str | None:
    """The client's ``X-Request-Id``, if it may label logs, spans and the response.

    Printable ASCII only (no control character can reach a log line or a header),
    at most :data:`MAX_REQUEST_ID_LENGTH` characters, surrounding spaces stripped;
    anything else is ignored (``None``), never an error: a label is a courtesy. It
    stays a label: tether's own rid is always the server's, so that no client can
    name another's request.
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip(" ")
    if not value or len(value) > MAX_REQUEST_ID_LENGTH or not _PRINTABLE.fullmatch(value):
        return None
    return value


def waiter_cancelled() -> None:
    """A task waiting for a stream's outputs was cancelled: tell the request's scope,
    since the framework may be cancelling because the client left."""
    scope = current_scope()
    if scope is not None:
        scope.cancelled()


def current_scope() -> RequestScope | None:
    """The scope of the HTTP request being handled, or ``None`` outside any.

    A scope that has closed is no scope: a task that inherited it (one started
    while a finished request was being handled, by a server or by the handler)
    opens streams of its own, never adopted by that finished request.
    """
    scope = _current.get()
    if scope is None or scope.ended:
        return None
    return scope


class _Wait:
    """One wait under :meth:`RequestScope.waiting`: the task to cut if the client leaves."""

    __slots__ = ("cut", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.cut = False  # the scope cancelled it (the client left)


class RequestScope:
    """Tracks the streams of one HTTP request; usable as ``with`` or ``async with``.

    Adapters for other frameworks: enter a scope around the handler, call
    :meth:`disconnect` from whatever notices the client leave, and let the scope
    exit close the rest.
    """

    __slots__ = (
        "_client_gone",
        "_consumers",
        "_ended",
        "_on_first_track",
        "_prune_at",
        "_reason",
        "_token",
        "_waits",
        "request_id",
    )

    def __init__(
        self,
        *,
        on_first_track: Callable[[], object] | None = None,
        client_gone: Callable[[], bool] | None = None,
        request_id: str | None = None,
    ) -> None:
        """:param on_first_track: called once, when the scope first has something that
            the client's leaving must reach: its first stream or batch, or a wait of
            tether's (:meth:`waiting`). An adapter can start watching the client only
            for those requests (the Starlette adapter starts its ``receive`` reader).
        :param client_gone: tells whether the client has left; asked when a task
            waiting on one of the scope's streams is cancelled, so that a framework
            that cancels handlers on disconnect (aiohttp's ``handler_cancellation``)
            records a client disconnect rather than a plain cancellation.
        :param request_id: the client's own label for this request (an adapter takes
            it from ``X-Request-Id``): stamped on every request opened in the scope,
            for logs and observers. It never becomes a rid: a client must not be
            able to choose another client's rid."""
        self.request_id = request_id
        self._consumers: list[Tracked] = []
        self._prune_at = _PRUNE_FLOOR
        self._on_first_track = on_first_track
        self._client_gone = client_gone
        self._reason: AbortReason | None = None
        self._token: contextvars.Token[RequestScope | None] | None = None
        self._ended = False
        self._waits: list[_Wait] | None = None  # (made by the first wait: few requests wait)

    @property
    def ended(self) -> bool:
        """Whether the scope was closed (its request is over): it adopts nothing more."""
        return self._ended

    @property
    def disconnected(self) -> bool:
        """Whether :meth:`disconnect` was called."""
        return self._reason is not None

    def __enter__(self) -> Self:
        if self._token is not None:
            raise RuntimeError("a RequestScope can be entered only once")
        self._token = _current.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
        self.close()

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def track(self, consumer: Tracked) -> None:
        """Adopt a stream or batch (``Registry.open`` does this for the current scope).

        The scope holds a consumer only while it may have work to cancel: a scope
        that lives long (a WebSocket handler, an agent loop opening stream after
        stream) lets go of the finished ones, so it holds at most about twice as
        many consumers as are live, never every stream it ever adopted.

        :raises RuntimeError: the scope ended (its request is over): ``consumer`` is
            cancelled (a follower detached), since nothing would ever end it.
        """
        if self._ended:
            _leave(consumer, AbortReason.CANCELLED)
            raise RuntimeError(
                "this request is over (its scope ended); nothing can answer it any more: "
                "respond() from the handler, before it returns"
            )
        consumers = self._consumers
        consumers.append(consumer)
        if len(consumers) >= self._prune_at:
            consumers[:] = [kept for kept in consumers if not kept.finished]
            self._prune_at = max(_PRUNE_FLOOR, 2 * len(consumers))
        hook = self._on_first_track
        if hook is not None:
            self._on_first_track = None
            hook()

    def adopt(self, consumer: Tracked) -> None:
        """Track ``consumer`` unless the scope already does: an adapter's ``respond()``
        calls it, so that a stream opened elsewhere (by a dispatcher task, or before
        this request) is still cancelled when this request's client leaves.

        :raises RuntimeError: the scope ended, as for :meth:`track`.
        """
        consumers = self._consumers
        if not consumers or consumers[-1] is not consumer:  # (the usual case: just opened)
            for tracked in consumers:
                if tracked is consumer:
                    return
            self.track(consumer)

    def release(self, consumer: Tracked) -> None:
        """Stop tracking ``consumer``: something else owns it now (a resumable stream
        outlives the request that opened it), so neither a disconnect nor the end of
        this scope cancels it. Releasing what is not tracked does nothing."""
        consumers = self._consumers
        for index, kept in enumerate(consumers):
            if kept is consumer:
                del consumers[index]
                return

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait of tether's for this request before it has anything to track
        (a reconnect that waits for a shared store): the adapter watches the client
        from now on (``on_first_track``), and a :meth:`disconnect` during the wait
        cancels the waiting task out of it, so that the work it waited for is
        withdrawn at once rather than done for a client that left. What runs inside
        must be safe to cancel at any await.

        :raises Aborted: the client left before the wait, or during it and cut it
            (reason ``client_disconnected``); a cancellation of the task by anyone else
            goes on as :class:`asyncio.CancelledError`. A wait that ended all the same
            returns: look at :attr:`disconnected` before acting on what it got.
        :raises RuntimeError: not in a task.
        """
        self.check()
        hook = self._on_first_track
        if hook is not None:
            self._on_first_track = None
            hook()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("RequestScope.waiting() is for a wait in a task")
        wait, cancelling = _Wait(task), task.cancelling()
        waits = self._waits
        if waits is None:
            waits = self._waits = []
        waits.append(wait)
        try:
            yield
        except asyncio.CancelledError:
            if wait.cut:
                wait.cut = False  # (its cancellation taken back here, once)
                if task.uncancel() <= cancelling:  # ours alone: the client left
                    raise Aborted(
                        "-", self._reason or AbortReason.CLIENT_DISCONNECTED, _LEFT_WAITING
                    ) from None
            raise
        finally:
            waits.remove(wait)
            if wait.cut:  # (the wait ended without its cancellation: none is owed)
                task.uncancel()

    def check(self) -> None:
        """Raise :class:`~tether.Aborted` if the client already disconnected."""
        if self._reason is not None:
            raise Aborted("-", self._reason, "the client disconnected before the request opened")

    def cancelled(self) -> None:
        """A task waiting on one of this scope's streams is being cancelled: if the
        client has left (``client_gone``), that is a disconnect of the whole scope."""
        client_gone = self._client_gone
        if client_gone is not None and self._reason is None and client_gone():
            self.disconnect()

    def disconnect(self, reason: AbortReason = AbortReason.CLIENT_DISCONNECTED) -> int:
        """Cancel every open stream of this request now; returns how many were live.

        Idempotent: later calls do nothing. Streams opened afterwards in this scope
        raise :class:`~tether.Aborted` at once.
        """
        if self._reason is not None:
            return 0
        self._reason = reason
        if self._waits:
            self._cut_waits()
        return sum(_leave(consumer, reason) for consumer in self._consumers)

    def _cut_waits(self) -> None:
        """Cancel the tasks waiting under :meth:`waiting` (the client left); a task that
        is running now (it disconnects its own scope) meets the end of its wait first."""
        running = asyncio.current_task()
        for wait in self._waits or ():
            if wait.task is not running and not wait.cut:
                wait.cut = True
                wait.task.cancel()

    def close(self) -> int:
        """Cancel whatever is still open (the handler is done); returns how many were live.

        From now on the scope adopts nothing: see :func:`current_scope`.
        """
        self._ended = True
        self._on_first_track = None  # (an adapter's bound method, which may hold the scope)
        consumers, self._consumers = self._consumers, []
        live = 0
        for consumer in consumers:  # (a loop, not sum() of a generator: once per request)
            live += _leave(consumer, AbortReason.CANCELLED)
        return live
