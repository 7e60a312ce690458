"""Resumable streams: a client that reconnects with ``Last-Event-ID`` continues where
it left off, exactly once and in order.

A resumable response is not read from its :class:`~tether.Stream` by the HTTP
handler. :meth:`Resume.open` hands the stream to a pump task (owned by the store)
that records every output in a log, numbered from 1, and gives the handler a
:class:`Follower` of that log; a reconnect gets another follower
(:meth:`Resume.follow`), which replays what came after its ``Last-Event-ID`` and
then follows the live tail. A follower is what the request's scope tracks, so a
client that leaves only detaches it: the request is *parked*, not aborted, and
its outputs keep being recorded for the grace period. The one follower attached
at a time is the newest (an older one ends quietly).

The request is aborted (``on_abort``, exactly once, by the stream's own path) when
the grace period passes with no client attached (reason ``client_disconnected``),
when more than ``max_events`` outputs, or ``max_bytes`` of them, wait for a client
(reason ``consumer_too_slow``), on a Stop (:meth:`Resume.cancel`, at once: a closed
connection alone cannot tell Stop from a network drop), or when the registry
closes. A stream that ended stays resumable for the grace period, so a late
reconnect still gets its tail.

Event ids are ``<token>.<n>``: the resume token (128 random bits, separate from
the rid, bound to one stream) and the event's number. A browser ``EventSource``
sends the last one back by itself when it reconnects to the same URL; a
``fetch`` reader sends it as the ``Last-Event-ID`` header or the
``last_event_id`` query parameter, or the token alone (``Tether-Resume-Token``
header, ``resume_token`` parameter, from the response's header) to resume before
the first event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from ._batch import Batch
from ._errors import Aborted, AbortReason
from ._limits import DEFAULT_MAX_PENDING_BYTES
from ._memory_store import MemoryStore
from ._responses import TOKEN_HEADER, ErrorResponse
from ._resume_log import Follower
from ._scope import RequestScope, current_scope
from ._stream import Stream

__all__ = [
    "NOT_RESUMABLE",
    "RESUME_UNAVAILABLE",
    "TOKEN_HEADER",
    "Resume",
    "ResumePoint",
    "resume_point",
]

_MAX_ID_LENGTH: Final = 128
"""A Last-Event-ID longer than this is no id tether wrote."""

NOT_RESUMABLE: Final = ErrorResponse(
    404,
    {"error": {"message": "there is no resumable stream here", "type": "NotFound", "code": 404}},
    {},
)
"""The answer to a reconnect whose token is wrong or expired, or whose event is no
longer held: one body for every case, so that it reveals nothing."""

RESUME_UNAVAILABLE: Final = ErrorResponse(
    503,
    {
        "error": {
            "message": "resumable streams cannot be reached now; retry",
            "type": "Unavailable",
            "code": 503,
        }
    },
    {"retry-after": "1"},
)
"""The answer to a reconnect when the store cannot be reached (a shared store whose
server is down): the stream may well exist, so no 404; the client may retry."""

logger = logging.getLogger("tether")


class ResumePoint:
    """Where a reconnect asks to resume: a token and the last event number it saw."""

    __slots__ = ("after", "token")

    def __init__(self, token: str, after: int) -> None:
        self.token = token
        self.after = after

    def __repr__(self) -> str:  # never the token: it is a credential
        return f"<ResumePoint after={self.after}>"


_INVALID: Final = ResumePoint("", -1)


def resume_point(last_event_id: str | None, token: str | None) -> ResumePoint | None:
    """Read a reconnect's resume point from what the client sent.

    :param last_event_id: the ``Last-Event-ID`` header or ``last_event_id`` query
        parameter: ``<token>.<n>`` as tether writes it, or ``<n>`` with ``token``.
    :param token: the ``Tether-Resume-Token`` header or ``resume_token`` parameter.
    :returns: ``None`` when the request is no reconnect (neither was sent); a point
        that matches no stream when what was sent is malformed or contradicts itself.
    """
    # (the whitespace around a header value is no part of it: some servers keep it)
    last_event_id, token = (last_event_id or "").strip(), (token or "").strip()
    if not last_event_id:
        if not token:
            return None
        return ResumePoint(token, 0) if _plausible(token) else _INVALID
    if len(last_event_id) > _MAX_ID_LENGTH:
        return _INVALID
    claimed, dot, number = last_event_id.rpartition(".")
    if dot:
        if token and token != claimed:
            return _INVALID
        token = claimed
    if not _plausible(token) or not number.isascii() or not number.isdigit():
        return _INVALID
    return ResumePoint(token, int(number))


def _plausible(token: str) -> bool:
    """Whether ``token`` could be one a store wrote into an event id: bounded as event
    ids are, printable ASCII (a 60 KB header is refused here, not looked up)."""
    return 0 < len(token) <= _MAX_ID_LENGTH and token.isascii() and token.isprintable()


class Resume:
    """Makes streams resumable: the policy and the store of their logs.

    Make one per application and pass it to the adapter's ``respond(..., resume=)``
    and ``resume(request, ...)``; ``await aclose()`` at shutdown (closing the
    registry also ends every parked stream, by aborting it).

    :param grace: seconds a stream whose client left stays alive waiting for a
        reconnect, and a stream that ended stays resumable.
    :param max_events: how many outputs may wait for a client (parked, or one that
        reads too slowly) before the request is aborted; also how many events are
        kept for a reconnect.
    :param store: where the logs live; an in-process :class:`MemoryStore` by default.
    :param max_bytes: the same bound in bytes (outputs weighed by
        :func:`~tether.approximate_size`), as the registry's ``max_pending_bytes`` bounds
        a stream that is not resumable: past it the request is aborted (reason
        ``consumer_too_slow``); also about how many bytes are kept for a reconnect.
        ``None``: no byte budget (and no weighing).
    :raises ValueError: a non-positive ``grace``, ``max_events`` or ``max_bytes``.
    """

    __slots__ = ("grace", "max_bytes", "max_events", "store")

    def __init__(
        self,
        *,
        grace: float = 30.0,
        max_events: int = 10_000,
        store: MemoryStore | None = None,
        max_bytes: int | None = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        if not grace > 0:
            raise ValueError(f"grace must be a positive number of seconds, got {grace}")
        if isinstance(max_events, bool) or max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 1):
            raise ValueError(f"max_bytes must be at least 1 or None, got {max_bytes}")
        self.grace = grace
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.store = store if store is not None else MemoryStore()

    def __repr__(self) -> str:
        return f"<Resume grace={self.grace:g} max_events={self.max_events}>"

    async def open(self, stream: Stream | Batch | Follower) -> Follower:
        """Make ``stream`` resumable; the follower that answers its first request.

        The stream leaves the current request scope (a client that leaves no longer
        aborts it); the follower joins it instead. From now on the store owns the
        stream. Returns once the store knows the token everywhere (a shared store
        publishes it first), so a client that has seen it can resume or stop anywhere.

        :raises TypeError: ``stream`` is not a :class:`~tether.Stream` (it is aborted).
        :raises RuntimeError: ``stream`` was answered already, or closed.
        :raises Exception: whatever the store raised publishing it (it is aborted).
        """
        if not isinstance(stream, Stream):
            (stream.abort if isinstance(stream, Follower) else stream.cancel)()
            raise TypeError(f"only a tether Stream can be resumable, got {type(stream).__name__}")
        if not stream.claim():  # (answered: the response that has it keeps it)
            raise RuntimeError(
                f"{stream!r} was already answered or closed; a response takes a stream "
                "once: open another stream for another response"
            )
        follower = self.store.open(stream, self.grace, self.max_events, self.max_bytes)
        scope = current_scope()
        if scope is not None:
            scope.release(stream)
            _join(scope, follower)
        try:
            await self.store.opened(follower)
        except BaseException:
            follower.abort()
            raise
        return follower

    async def follow(self, point: ResumePoint) -> Follower | None:
        """A follower for a reconnect, or ``None`` (answer :data:`NOT_RESUMABLE`): the
        token is wrong or expired, or the event asked for is no longer held.

        The follower joins the current request scope; the client it replaces, if
        any, ends. A client that leaves while the store looks for the stream ends
        the look (:meth:`tether.RequestScope.waiting`), as does the end of the request.

        :raises tether.Aborted: the current request's client left meanwhile, or the
            request ended (a task of its handler's that outlived it).
        """
        scope = current_scope()
        if scope is None:
            return await self.store.follow(point.token, point.after)
        # A shared store may wait (for the log to catch up) before anything is tracked:
        # a client that leaves meanwhile cuts the wait, so that it claims nothing.
        follower: Follower | None = None
        try:
            with scope.waiting():
                follower = await self.store.follow(point.token, point.after)
        except Aborted as exc:
            if follower is not None:  # (the cut missed the wait: what it got is let go)
                follower.detach(exc.reason)
            raise
        if follower is not None:
            _join(scope, follower)
        return follower

    async def reconnect(
        self, headers: Mapping[str, str], query: Mapping[str, str]
    ) -> Follower | ErrorResponse | None:
        """Answer a request that may be a reconnect (an adapter's ``resume()``).

        A reconnect carries ``Last-Event-ID`` (header, or ``last_event_id`` query
        parameter) or the resume token alone (``Tether-Resume-Token`` header, or
        ``resume_token`` parameter): its follower gets every event after that id, then
        the live tail, and the client it replaces ends (see :meth:`follow`).

        :param headers: the request's headers, looked up by lower-case name (pass the
            framework's case-insensitive mapping).
        :param query: the request's query parameters.
        :returns: ``None`` when the request asks to resume nothing; :data:`NOT_RESUMABLE`
            (a 404 that says nothing more) when the token is wrong or expired, or the
            event is no longer held; a 503 (``Retry-After``) when the store cannot be
            reached (its ``follow`` raised :class:`ConnectionError`); else the follower
            that answers it.
        :raises tether.Aborted: the request's client left while the store looked.
        """
        point = resume_point(
            headers.get("last-event-id") or query.get("last_event_id"),
            headers.get(TOKEN_HEADER) or query.get("resume_token"),
        )
        if point is None:
            return None
        try:
            follower = await self.follow(point)
        except ConnectionError as exc:
            logger.warning("a reconnect could not reach the resumable streams' store: %s", exc)
            return RESUME_UNAVAILABLE
        return NOT_RESUMABLE if follower is None else follower

    async def cancel(self, token: str) -> bool:
        """Stop: abort the stream of ``token`` at once (``on_abort``) and forget it.

        :returns: whether the token named a stream (a live one is aborted; one that
            ended is only forgotten).
        :raises ConnectionError: a shared store could not be reached.
        """
        if not _plausible(token):  # (no store wrote it: nothing to ask one)
            return False
        return await self.store.cancel(token)

    async def aclose(self) -> None:
        """Abort every parked or live resumable stream and forget every log."""
        await self.store.aclose()


def _join(scope: RequestScope, follower: Follower) -> None:
    """Let ``scope`` track ``follower``; a client already gone detaches it at once."""
    scope.track(follower)
    if scope.disconnected:
        follower.detach(AbortReason.CLIENT_DISCONNECTED)
