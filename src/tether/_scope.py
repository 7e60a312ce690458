"""RequestScope: the per-HTTP-request context that adapters open.

An adapter opens one scope around each HTTP request. Every ``Stream`` or
``Batch`` opened while it is current (a :mod:`contextvars` variable, so it
follows the handler into the tasks it starts) is tracked; :meth:`disconnect`
cancels them all at once when the client goes away, and cuts any wait of tether's
for the request that began before it had anything to track
(:meth:`~RequestScope.waiting`); leaving the scope closes whatever the handler
left open and cuts any such wait that goes on, so no path leaves a request behind.
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
    "wait_withdrawn",
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
_waiting: contextvars.ContextVar[_Wait | None] = contextvars.ContextVar(
    "tether_request_wait", default=None
)


_LEFT_WAITING: Final = "the client disconnected while the request waited"
_ENDED_WAITING: Final = "the request ended while it waited (its handler returned)"


class Tracked(Protocol):
    """What a scope needs of what it tracks (a ``Stream``, ``Batch`` or ``Follower``, or a
    wait of :meth:`RequestScope.waiting`)."""

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


def wait_withdrawn() -> bool:
    """Whether the current task waits for a request (:meth:`RequestScope.waiting`)
    that no longer wants the wait: its client left, or the request ended. A store
    looks before an act it cannot take back (a claim that ends another client), since
    the cut that would have ended the wait may not have reached it yet."""
    wait = _waiting.get()
    return wait is not None and wait.withdrawn


_RECUT: Final = 0.01
"""Seconds after which a wait that a cut did not end is cut again: a cancellation can
be lost on its way (3.11's ``asyncio.wait_for`` drops one that arrives as what it wraps
completes), and a wait of tether's must not outlive its client because of one."""


class _Wait:
    """One wait under :meth:`RequestScope.waiting`, tracked by its scope as a stream
    is: a disconnect, or the end of the scope, cuts the task out of it."""

    __slots__ = ("cuts", "finished", "recut", "task", "withdrawn")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.finished = False  # the wait is over (what its scope asks of what it tracks)
        self.withdrawn = False  # its scope no longer wants it (the client left, or it ended)
        self.cuts = 0  # how many times it was cancelled for that
        self.recut: asyncio.TimerHandle | None = None  # the next cut, until the wait ends

    def cancel(self, reason: AbortReason = AbortReason.CANCELLED) -> bool:
        """The scope no longer wants the wait: cut the task out of it, unless that task
        is running now (it ends its own scope, and meets the end of its wait first).
        Whether it was cut."""
        if self.finished or self.withdrawn:
            return False
        self.withdrawn = True
        if self.task is asyncio.current_task():
            return False
        self._cut()
        return True

    def _cut(self) -> None:
        """Cancel the task, and again every :data:`_RECUT` seconds until the wait ends
        (:meth:`end`): no single cancellation has to arrive."""
        self.cuts += 1
        self.task.cancel()
        self.recut = self.task.get_loop().call_later(_RECUT, self._cut)

    def end(self) -> None:
        """The wait is over: no more cuts."""
        self.finished = True
        if self.recut is not None:
            self.recut.cancel()
            self.recut = None


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
        from now on (``on_first_track``), and a :meth:`disconnect` during the wait, or
        the end of the scope (:meth:`close`: the request is over), cuts the waiting
        task out of it, so that the work it waited for is withdrawn at once rather than
        done for nobody. The cut is a cancellation, repeated until the wait ends (one
        can be lost on its way: 3.11's ``asyncio.wait_for`` drops one that arrives as
        what it wraps completes). What runs inside must be safe to cancel at any await,
        and should look at :func:`wait_withdrawn` before an act it cannot take back.

        :raises Aborted: the client left before the wait, or during it (reason
            ``client_disconnected``), or the request ended during it (``cancelled``),
            whether or not the cut reached the wait: a wait that completed all the same
            raises too, and what it got is the caller's to let go. A cancellation of the
            task by anyone else goes on as :class:`asyncio.CancelledError`.
        :raises RuntimeError: not in a task.
        """
        self.check()
        if self._ended:
            raise self._withdrawn()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("RequestScope.waiting() is for a wait in a task")
        wait, cancelling = _Wait(task), task.cancelling()
        self.track(wait)  # (the adapter starts watching the client, if it had not)
        token = _waiting.set(wait)
        try:
            yield
        except asyncio.CancelledError:
            wait.end()
            cuts, wait.cuts = wait.cuts, 0  # (its cancellations taken back here, once)
            if cuts:
                for _ in range(cuts):
                    task.uncancel()
                if task.cancelling() <= cancelling:  # ours alone: the request is gone
                    raise self._withdrawn() from None
            raise
        finally:
            wait.end()
            _waiting.reset(token)
            self.release(wait)
            for _ in range(wait.cuts):  # (none of its cancellations is owed any more)
                task.uncancel()
        if wait.withdrawn:  # (ended all the same: its cut lost on its way, or not sent)
            raise self._withdrawn()

    def _withdrawn(self) -> Aborted:
        """What a wait of this scope's that was withdrawn ends with."""
        if self._reason is not None:
            return Aborted("-", self._reason, _LEFT_WAITING)
        return Aborted("-", AbortReason.CANCELLED, _ENDED_WAITING)

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
        return sum(_leave(consumer, reason) for consumer in self._consumers)

    def close(self) -> int:
        """Cancel whatever is still open (the handler is done), and cut every wait of
        :meth:`waiting` that goes on (a task the handler started, a shielded reconnect):
        nothing can answer it any more. Returns how many were live.

        From now on the scope adopts nothing: see :func:`current_scope`.
        """
        self._ended = True
        self._on_first_track = None  # (an adapter's bound method, which may hold the scope)
        consumers, self._consumers = self._consumers, []
        live = 0
        for consumer in consumers:  # (a loop, not sum() of a generator: once per request)
            live += _leave(consumer, AbortReason.CANCELLED)
        return live
