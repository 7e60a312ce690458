"""Exchange: drives one HTTP response from a ``Stream`` or ``Batch``, with no web
framework in sight.

It decides the status line (which waits for the first output, so that a failure
before it gets a real status rather than a 200 followed by an error event), frames
every ready output into one chunk, pings when idle, and ends with one error event
and the terminal frame when the request fails after the stream has started. An
adapter only moves the bytes it gives: ``start()``, then ``next_chunk()`` until
:attr:`Exchange.done`, each write through :meth:`Exchange.bounded`; and
``aclose()`` in a ``finally``. A handler cancelled by its server (shutdown) still
ends its response: :meth:`Exchange.farewell` gives the last bytes. An adapter that
can write without waiting may also write from the producer's step, through the
stream's sink (``Stream.set_sink``), framing with :meth:`Exchange.sink_chunk`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Final

from ._batch import Batch
from ._channel import Follower
from ._encoders import SSE, Encoder, default_dumps
from ._errors import Aborted, AbortReason, TetherError
from ._framing import Framer, jsonable
from ._guard import SendGuard
from ._responses import DEFAULT_SEND_TIMEOUT, JSON_HEADERS, Head, error_response
from ._resume import TOKEN_HEADER
from ._scope import current_scope
from ._stream import Stream

__all__ = ["FAREWELL_TIMEOUT", "Exchange"]

logger = logging.getLogger("tether")

FAREWELL_TIMEOUT: Final = 1.0
"""Seconds an adapter gives the last write of a response whose handler the server
cancelled (:meth:`Exchange.farewell`): enough for a client that reads, short for one
that stopped."""

_CLIENT_GONE: Final = (AbortReason.CLIENT_DISCONNECTED, AbortReason.CANCELLED)
"""Why a stream may end with nothing more written: nobody reads it."""

_SSE: Final = SSE()
"""The default framing, shared: an encoder holds no state of its own response."""


class Exchange:
    """Drives one HTTP response from a :class:`~tether.Stream` or :class:`~tether.Batch`.

    :param source: what to answer with (a :class:`~tether.Follower` for a resumable
        stream: its outputs carry event ids, its error event is named ``error``).
    :param streaming: stream every output (``True``) or answer with one JSON body.
    :param encoder: the streaming framing; :class:`~tether.SSE` by default.
    :param ping_interval: seconds of silence after which a keep-alive is sent.
    :param send_timeout: seconds one write of the response may wait for a client
        that stopped reading (the server's writes blocked by flow control); past it,
        the adapter treats the client as gone: the request is aborted and freed, the
        connection closed where the framework allows. ``None`` waits for ever.
    :raises ValueError: a non-positive ``ping_interval`` or ``send_timeout`` (the
        source is aborted: the exchange owns it from the start).
    """

    __slots__ = (
        "_done",
        "_framer",
        "_guard",
        "_numbered",
        "encoder",
        "ping_interval",
        "send_timeout",
        "source",
        "streaming",
    )

    def __init__(
        self,
        source: Stream | Batch | Follower,
        *,
        streaming: bool,
        encoder: Encoder | type[Encoder] | None = None,
        ping_interval: float = 15.0,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        if not isinstance(source, Stream | Batch | Follower):
            raise TypeError(f"expected a tether Stream or Batch, got {type(source).__name__}")
        if encoder is None:
            encoder = _SSE
        elif isinstance(encoder, type):
            encoder = encoder()
        numbered = isinstance(source, Follower)
        bad = None
        if numbered and not (streaming and encoder.has_event_ids):
            bad = "a resumable stream is streamed with event ids: streaming=True and SSE"
        elif not ping_interval > 0:
            bad = f"ping_interval must be positive, got {ping_interval}"
        elif send_timeout is not None and not send_timeout > 0:
            bad = f"send_timeout must be positive or None, got {send_timeout}"
        if bad is not None:
            # the exchange owned the source all the same: nothing is left open
            (source.abort if isinstance(source, Follower) else source.cancel)()
            raise ValueError(bad)
        self.source = source
        self.streaming = streaming
        self.encoder: Encoder = encoder
        self.ping_interval = ping_interval
        self.send_timeout = send_timeout
        # A resumable stream's outputs come with their event ids (see _resume).
        self._numbered = numbered
        # (a one-shot JSON answer writes once: no send timeout's guard unless asked for)
        self._guard: SendGuard | None = SendGuard(send_timeout) if streaming else None
        inline = isinstance(source, Batch) and source.keep_going
        batch = isinstance(source, Batch)
        self._framer = Framer(encoder, indexed=batch, errors_inline=inline, numbered=numbered)
        self._done = False

    @property
    def _bound(self) -> SendGuard:
        if self._guard is None:
            self._guard = SendGuard(self.send_timeout)
        return self._guard

    @property
    def done(self) -> bool:
        """Whether the response has nothing more to send: the one end signal.

        After :meth:`start`: the head's body is the whole response (answer it with
        a plain, sized response). Later: the last chunk was handed out.
        """
        return self._done

    def _error_head(self, exc: BaseException) -> Head:
        self._done = True
        response = error_response(exc)
        headers = {**JSON_HEADERS, **response.headers}
        return Head(response.status, headers, default_dumps(response.body))

    async def start(self) -> Head:
        """Wait until the status line is known and return it with the first bytes.

        Non-streaming: waits for the result. Streaming: waits for the first outputs,
        or the ping interval, whichever comes first. Errors raised by the source
        before that become an error status with a JSON body; so does an output the
        encoder cannot serialise (500, and the work is aborted). A stream that is
        already over is answered whole, terminal frame included (:attr:`done`).
        """
        if not self.streaming:
            try:
                result = await self.source.result()
            except TetherError as exc:
                return self._error_head(exc)
            if isinstance(result, list):
                result = [jsonable(item) for item in result]
            try:
                body = self.encoder.dumps(result)
            except Exception as exc:
                return self._unencodable_head(exc)
            self._done = True
            return Head(200, self._success_headers(), body)
        try:
            items = await self.source.next_ready(timeout=self.ping_interval)
        except TetherError as exc:
            return self._error_head(exc)
        encoder = self.encoder
        headers = self._success_headers()
        first = encoder.preamble()
        if items is None:
            self._done = True
            return Head(200, headers, first + encoder.terminal())
        if not items:
            return Head(200, headers, first + encoder.ping())
        framer = self._framer
        try:
            chunk = framer.some(items)
        except Exception as exc:
            return self._unencodable_head(exc)
        if framer.carry is None and self.source.exhausted:
            self._done = True
            return Head(200, headers, first + chunk + encoder.terminal())
        return Head(200, headers, first + chunk if first else chunk)

    def _unencodable(self, exc: Exception) -> None:
        logger.error(
            "%r: an output could not be encoded; the request is aborted", self.source, exc_info=exc
        )
        self.source.cancel(AbortReason.SERVER)

    def _unencodable_head(self, exc: Exception) -> Head:
        self._unencodable(exc)
        return self._error_head(exc)

    def _success_headers(self) -> dict[str, str]:
        if not self.streaming:
            return dict(JSON_HEADERS)
        encoder = self.encoder
        headers = {
            "content-type": encoder.media_type,
            **{k.lower(): v for k, v in encoder.headers.items()},
        }
        source = self.source
        if isinstance(source, Follower):
            headers[TOKEN_HEADER] = source.token
        return headers

    async def start_head_only(self) -> Head:
        """Answer a HEAD request: abort the work now and return a successful head.

        Nobody will read the body, so the source is closed at once (the producer is
        told through ``on_abort``) and the head carries the headers a GET would
        start with, status 200 and no body.
        """
        await self.aclose()
        return Head(200, self._success_headers(), b"")

    def ready_chunk(self) -> bytes | None:
        """The next bytes to write if they are ready now (outputs, the end, an error),
        without waiting; ``None`` when the adapter has to wait: ``await next_chunk()``.

        The write loop of an adapter: ``chunk = exchange.ready_chunk()``, and only if
        that is ``None``, ``chunk = await exchange.next_chunk()``. No coroutine is made
        for a chunk that was ready.
        """
        if self._done:
            return b""
        framer = self._framer
        carry = framer.carry
        if carry is not None:
            framer.carry = None
            return self._chunk(carry)
        try:
            items = self.source.ready()
        except TetherError as exc:
            return self._failed(exc)
        if items == []:
            return None
        return self._chunk(items)

    def sink_chunk(self, outputs: list[Any]) -> bytes | None:
        """``outputs`` (handed to a ``Stream.set_sink`` sink in the producer's step) as
        one chunk to write now; ``None`` when the sink must decline them (they wait
        again, and the write loop reads them with :meth:`ready_chunk`: an output that
        does not encode fails the request there). Never ends, aborts or raises.
        """
        framer = self._framer
        if self._done or framer.carry is not None:
            return None
        try:
            return framer.encode(outputs)
        except Exception:
            return None

    async def next_chunk(self) -> bytes:
        """The next bytes to write, while not :attr:`done`: every ready output in one
        chunk, a ping after ``ping_interval`` of silence, the terminal frame at the end
        (or one error event and the terminal frame on failure).

        A client disconnect ends the response quietly (``b""``, and :attr:`done`):
        nobody is reading.
        """
        chunk = self.ready_chunk()
        return await self.wait_chunk() if chunk is None else chunk

    async def wait_chunk(self) -> bytes:
        """:meth:`next_chunk` for a write loop that just got ``None`` from
        :meth:`ready_chunk`: wait (up to ``ping_interval``), then the next bytes."""
        await self.source.wait_ready(timeout=self.ping_interval)
        return self.waited_chunk()

    def waited_chunk(self) -> bytes:
        """What :meth:`wait_chunk` returns after its wait, for a write loop that awaits
        ``source.wait_ready(timeout=ping_interval)`` itself (one coroutine less)."""
        chunk = self.ready_chunk()
        return self.encoder.ping() if chunk is None else chunk

    def _chunk(self, items: list[Any] | None) -> bytes:
        encoder = self.encoder
        if items is None:
            self._done = True
            return encoder.terminal()
        framer = self._framer
        try:
            chunk = framer.some(items)
        except Exception as exc:
            self._unencodable(exc)
            return self._failed(exc)
        if framer.carry is None and self.source.exhausted:
            # The last outputs and the terminal frame go out in one write.
            self._done = True
            return chunk + encoder.terminal()
        return chunk

    def _failed(self, exc: Exception) -> bytes:
        """The end of a stream that failed after its start: one error event and the
        terminal frame; nothing when its client left (nobody reads)."""
        self._done = True
        if isinstance(exc, Aborted) and exc.reason in _CLIENT_GONE:
            return b""
        encoder = self.encoder
        return encoder.error(error_response(exc).body, event=self._error_event) + encoder.terminal()

    @property
    def _error_event(self) -> str | None:
        # A resumable stream names its error event: a reconnecting client tells it apart.
        return "error" if self._numbered else None

    def writing(self) -> None:
        """A write of this response starts now: it is bounded by ``send_timeout``.

        For the hot write loop, instead of :meth:`bounded`: call it before each
        write and :meth:`written` after; when the write is interrupted by
        ``CancelledError``, ask :meth:`stalled` whether the bound cut it.
        """
        (self._guard or self._bound).begin()

    def written(self) -> None:
        """The write started by :meth:`writing` is over."""
        (self._guard or self._bound).end()

    def stalled(self) -> bool:
        """After ``CancelledError`` in a write begun with :meth:`writing`: whether the
        send timeout cut it (the client stopped reading). Then the cancellation is
        consumed, the request is aborted as for a disconnect, and the adapter ends
        the response without raising; else the cancellation is someone else's."""
        if not self._bound.stalled_out():
            return False
        self._client_stalled()
        return True

    def _client_stalled(self) -> None:
        logger.warning(
            "%r: the client read nothing for %gs; it counts as gone (as a disconnect)",
            self.source,
            self.send_timeout,
        )
        scope = current_scope()
        if scope is not None:
            scope.disconnect()
        else:
            self.source.cancel(AbortReason.CLIENT_DISCONNECTED)
        self._done = True

    async def bounded(self, write: Awaitable[object]) -> bool:
        """Await one write of this response (a send, a flush), bounded by ``send_timeout``.

        A write that waits longer means the client stopped reading without closing
        its connection: the request's scope is told the client is gone (so the work
        is aborted and freed, as for a disconnect), the write is abandoned, and the
        result is ``False``; the adapter then ends the response (and drops the
        connection where its framework allows). One timer per response, not one per
        write, so the bound costs next to nothing on the hot path.

        :returns: ``True`` once the write completed.
        """
        if await self._bound.write(write):
            return True
        self._client_stalled()
        return False

    def farewell(self) -> bytes:
        """The last bytes of a stream whose handler the server cancelled (a shutdown
        whose grace period ran out): the work is aborted now, and the client, still
        there, is told so with one error event (503: the server ended the request) and
        the terminal frame, after whatever the exchange held. Never waits.
        """
        self._done = True
        source = self.source
        source.cancel(AbortReason.CANCELLED)
        framer = self._framer
        carry = framer.take_carry()
        try:
            held = framer.encode(carry) if carry else b""
        except Exception:  # unencodable: what matters now is the end
            held = b""
        encoder = self.encoder
        body = error_response(self._server_abort()).body
        return held + encoder.error(body, event=self._error_event) + encoder.terminal()

    def farewell_head(self) -> Head:
        """The whole answer to a request whose handler the server cancelled before its
        status line went out: the work is aborted now; a JSON 503. Never waits."""
        self.source.cancel(AbortReason.CANCELLED)
        return self._error_head(self._server_abort())

    def _server_abort(self) -> Aborted:
        source = self.source
        rid = source.rids[0] if isinstance(source, Batch) else source.rid
        return Aborted(rid, AbortReason.SERVER, f"request {rid!r} was ended by the server")

    async def aclose(self) -> None:
        """End the response: whatever is unfinished is aborted and freed (idempotent).

        It never waits: the source is freed synchronously and an asynchronous
        ``on_abort`` runs as a task the registry owns and bounds. So adapters call it
        in a ``finally`` even while their task is being cancelled.
        """
        self._done = True
        if self._guard is not None:
            self._guard.close()
        await self.source.aclose()
