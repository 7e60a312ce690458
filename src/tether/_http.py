"""The HTTP policy both adapters share, with no web framework in sight.

* :func:`error_response` is the one mapping from an exception to an HTTP status,
  a JSON error body and headers.
* :class:`Exchange` drives one response from a ``Stream`` or ``Batch``: it decides
  the status line (which waits for the first output, so that a failure before it
  gets a real status rather than a 200 followed by an error event), frames every
  ready output into one chunk, pings when idle, and ends with one error event and
  the terminal frame when the request fails after the stream has started.

An adapter only moves the bytes :class:`Exchange` gives it and tells the scope
when the client is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable
from typing import Any, Final

from ._batch import Batch
from ._encoders import SSE, Encoder, default_dumps
from ._errors import (
    Aborted,
    AbortReason,
    BatchTooLarge,
    ConsumerTooSlow,
    DuplicateRequest,
    InvalidRequestId,
    Overloaded,
    ProducerError,
    RegistryClosed,
    RequestTimeout,
    TetherError,
    UnknownRequest,
)
from ._guard import SendGuard
from ._scope import current_scope
from ._stream import Stream

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "ErrorResponse",
    "Exchange",
    "Head",
    "error_body",
    "error_response",
]

logger = logging.getLogger("tether")

CLIENT_CLOSED_REQUEST: Final = 499
"""The status logged for a request whose client left (nobody reads it)."""

DEFAULT_SEND_TIMEOUT: Final = 30.0
"""Seconds one write may wait for a client that stopped reading (see :class:`Exchange`)."""

JSON_HEADERS: Final = {"content-type": "application/json"}

WRITE_BYTES: Final = 256 * 1024
"""About how many bytes one chunk of a stream carries when a backlog is ready: ready
outputs are coalesced into one write up to this, and a larger backlog goes out over
several writes, so that it is never copied whole into one buffer."""

_FIRST_SLICE: Final = 4
"""How many outputs are encoded before their size is known."""


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorResponse:
    """What an exception becomes on the wire.

    :param status: the HTTP status code.
    :param body: ``{"error": {"message": ..., "type": ..., "code": status}}``.
    :param headers: extra headers (``Retry-After`` for 503s that can be retried).
    """

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def _status_of(exc: BaseException) -> tuple[int, dict[str, str]]:
    if isinstance(exc, Overloaded):
        return 503, {"retry-after": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, RegistryClosed):
        return 503, {"retry-after": "1"}
    if isinstance(exc, RequestTimeout):
        return 504, {}
    if isinstance(exc, ConsumerTooSlow):
        return 503, {}
    if isinstance(exc, Aborted):
        if exc.reason in (AbortReason.CLIENT_DISCONNECTED, AbortReason.CANCELLED):
            return CLIENT_CLOSED_REQUEST, {}
        return 503, {}
    if isinstance(exc, DuplicateRequest):
        return 409, {}
    if isinstance(exc, UnknownRequest):
        return 404, {}
    if isinstance(exc, BatchTooLarge):
        return 413, {}
    if isinstance(exc, InvalidRequestId):
        return 422, {}
    if isinstance(exc, ProducerError):
        # A producer may reject a request for the client's fault (a prompt too
        # long, say) by failing it with an exception carrying a 4xx status_code.
        status = getattr(exc.__cause__, "status_code", None)
        if isinstance(status, int) and 400 <= status <= 599:
            return status, {}
        return 500, {}
    return 500, {}


def error_body(exc: BaseException, status: int) -> dict[str, Any]:
    """The JSON error body for ``exc``: ``{"error": {"message", "type", "code"}}``.

    Exceptions outside tether's tree are reported as an internal error without
    their message, which may hold server details; so is a producer's exception
    behind a :class:`~tether.ProducerError`, unless it declares itself client-facing
    (see :class:`~tether.ProducerError`).
    """
    if isinstance(exc, TetherError):
        message, kind = str(exc), type(exc).__name__
    else:
        message, kind = "internal server error", "InternalError"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(exc: BaseException) -> ErrorResponse:
    """Map an exception to its status, JSON body and headers (the one shared mapping).

    ``Overloaded`` and ``RegistryClosed`` → 503 with ``Retry-After``;
    ``RequestTimeout`` → 504; ``ConsumerTooSlow`` and server aborts → 503;
    client disconnects → 499; ``DuplicateRequest`` → 409; ``UnknownRequest`` → 404;
    ``ProducerError`` → 500, or its cause's ``status_code`` when that is 4xx/5xx;
    ``BatchTooLarge`` → 413; ``InvalidRequestId`` → 422; anything else → 500.

    A producer's exception that the body does not show is logged here (``tether``
    logger, with its traceback), so that the detail the client is spared is not lost.
    """
    status, headers = _status_of(exc)
    if isinstance(exc, ProducerError) and status >= 500:
        # The text, not the error: a kept log record must not keep its traceback's frames.
        logger.error("%s (the client sees no detail)", str(exc), exc_info=exc.__cause__)
    return ErrorResponse(status, error_body(exc, status), headers)


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """How a response starts.

    :param status: the HTTP status.
    :param headers: lower-case header names to values.
    :param body: the first bytes of the body (the whole body when ``more`` is false).
    :param more: whether :meth:`Exchange.next_chunk` has more to give.
    """

    status: int
    headers: dict[str, str]
    body: bytes
    more: bool


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseException):
        return error_response(value).body
    return value


class Exchange:
    """Drives one HTTP response from a :class:`~tether.Stream` or :class:`~tether.Batch`.

    :param source: what to answer with.
    :param streaming: stream every output (``True``) or answer with one JSON body.
    :param encoder: the streaming framing; :class:`~tether.SSE` by default.
    :param ping_interval: seconds of silence after which a keep-alive is sent.
    :param send_timeout: seconds one write of the response may wait for a client
        that stopped reading (the server's writes blocked by flow control); past it,
        the adapter treats the client as gone: the request is aborted and freed, the
        connection closed where the framework allows. ``None`` waits for ever.
    :raises ValueError: a non-positive ``ping_interval`` or ``send_timeout``.
    """

    __slots__ = (
        "_carry",
        "_done",
        "_errors_inline",
        "_frame_bytes",
        "_guard",
        "_indexed",
        "encoder",
        "ping_interval",
        "send_timeout",
        "source",
        "streaming",
    )

    def __init__(
        self,
        source: Stream | Batch,
        *,
        streaming: bool,
        encoder: Encoder | type[Encoder] | None = None,
        ping_interval: float = 15.0,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        if not isinstance(source, Stream | Batch):
            raise TypeError(f"expected a tether Stream or Batch, got {type(source).__name__}")
        if not ping_interval > 0:
            raise ValueError(f"ping_interval must be positive, got {ping_interval}")
        if send_timeout is not None and not send_timeout > 0:
            raise ValueError(f"send_timeout must be positive or None, got {send_timeout}")
        if encoder is None:
            encoder = SSE()
        elif isinstance(encoder, type):
            encoder = encoder()
        self.source = source
        self.streaming = streaming
        self.encoder: Encoder = encoder
        self.ping_interval = ping_interval
        self.send_timeout = send_timeout
        self._guard = SendGuard(send_timeout)
        self._indexed = isinstance(source, Batch)
        self._errors_inline = isinstance(source, Batch) and source.keep_going
        self._done = False
        # Ready outputs not written yet (a backlog larger than WRITE_BYTES), and the
        # last chunk's bytes per output, to size the next one before encoding it.
        self._carry: list[Any] | None = None
        self._frame_bytes = 0

    @property
    def done(self) -> bool:
        """Whether the response has nothing more to send."""
        return self._done

    def _error_head(self, exc: BaseException) -> Head:
        self._done = True
        response = error_response(exc)
        headers = {**JSON_HEADERS, **response.headers}
        return Head(response.status, headers, default_dumps(response.body), False)

    async def start(self) -> Head:
        """Wait until the status line is known and return it with the first bytes.

        Non-streaming: waits for the result. Streaming: waits for the first outputs,
        or the ping interval, whichever comes first. Errors raised by the source
        before that become an error status with a JSON body; so does an output the
        encoder cannot serialise (500, and the work is aborted). A stream that is
        already over is answered whole, terminal frame included (``more`` false).
        """
        if not self.streaming:
            try:
                result = await self.source.result()
            except TetherError as exc:
                return self._error_head(exc)
            if isinstance(result, list):
                result = [_jsonable(item) for item in result]
            try:
                body = self.encoder.dumps(result)
            except Exception as exc:
                return self._unencodable_head(exc)
            self._done = True
            return Head(200, self._success_headers(), body, False)
        try:
            items = await self.source.next_ready(timeout=self.ping_interval)
        except TetherError as exc:
            return self._error_head(exc)
        encoder = self.encoder
        headers = self._success_headers()
        if items is None:
            self._done = True
            return Head(200, headers, encoder.terminal(), False)
        if not items:
            return Head(200, headers, encoder.ping(), True)
        try:
            chunk = self._encode_some(items)
        except Exception as exc:
            return self._unencodable_head(exc)
        if self._carry is None and self.source.exhausted:
            self._done = True
            return Head(200, headers, chunk + encoder.terminal(), False)
        return Head(200, headers, chunk, True)

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
        return {
            "content-type": encoder.media_type,
            **{k.lower(): v for k, v in encoder.headers.items()},
        }

    async def start_head_only(self) -> Head:
        """Answer a HEAD request: abort the work now and return a successful head.

        Nobody will read the body, so the source is closed at once (the producer is
        told through ``on_abort``) and the head carries the headers a GET would
        start with, status 200 and no body.
        """
        await self.aclose()
        return Head(200, self._success_headers(), b"", False)

    def _encode_some(self, items: list[Any]) -> bytes:
        """Encode the ready ``items`` into one chunk of about :data:`WRITE_BYTES` at most
        (at least one output); what does not fit waits in ``_carry`` for the next chunk.

        Outputs are encoded slice by slice, each slice sized from the bytes per output
        measured last, so a backlog is never encoded or joined whole. The usual case
        (small outputs, sizes known) is one slice and no copy of the list.
        """
        count = len(items)
        per_frame = self._frame_bytes
        if per_frame and per_frame * count <= WRITE_BYTES:
            chunk = self._encode(items)
            self._frame_bytes = len(chunk) // count or 1
            return chunk
        parts: list[bytes] = []
        size = done = 0
        while done < count and size < WRITE_BYTES:
            # Before anything was measured, a few outputs tell the size of the rest.
            take = max(1, (WRITE_BYTES - size) // per_frame) if per_frame else _FIRST_SLICE
            part = self._encode(items[done : done + take])
            taken = min(take, count - done)
            per_frame = len(part) // taken or 1
            parts.append(part)
            size += len(part)
            done += taken
        self._frame_bytes = per_frame
        if done < count:
            self._carry = items[done:]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _encode(self, items: list[Any]) -> bytes:
        if self._indexed:
            if self._errors_inline:
                # a keep-going batch yields a failed sub-request's error in its place
                items = [(index, _jsonable(output)) for index, output in items]
            return self.encoder.encode_indexed(items)
        return self.encoder.encode_many(items)

    async def next_chunk(self) -> bytes | None:
        """The next bytes to write: every ready output in one chunk, a ping after
        ``ping_interval`` of silence, the terminal frame at the end (or one error
        event and the terminal frame on failure); ``None`` when nothing is left.

        A client disconnect ends the response quietly (``None``): nobody is reading.
        """
        if self._done:
            return None
        encoder = self.encoder
        carry = self._carry
        try:
            if carry is not None:
                self._carry = None
                items: list[Any] | None = carry
            else:
                items = await self.source.next_ready(timeout=self.ping_interval)
        except Aborted as exc:
            self._done = True
            if exc.reason in (AbortReason.CLIENT_DISCONNECTED, AbortReason.CANCELLED):
                return None
            return encoder.error(error_response(exc).body) + encoder.terminal()
        except TetherError as exc:
            self._done = True
            return encoder.error(error_response(exc).body) + encoder.terminal()
        if items is None:
            self._done = True
            return encoder.terminal() or None
        if not items:
            return encoder.ping()
        try:
            chunk = self._encode_some(items)
        except Exception as exc:
            self._unencodable(exc)
            self._done = True
            return encoder.error(error_response(exc).body) + encoder.terminal()
        if self._carry is None and self.source.exhausted:
            # The last outputs and the terminal frame go out in one write.
            self._done = True
            return chunk + encoder.terminal()
        return chunk

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
        if await self._guard.write(write):
            return True
        logger.warning(
            "%r: the client read nothing for %gs; the request is aborted",
            self.source,
            self.send_timeout,
        )
        scope = current_scope()
        if scope is not None:
            scope.disconnect()
        else:
            self.source.cancel(AbortReason.CLIENT_DISCONNECTED)
        self._done = True
        return False

    async def aclose(self) -> None:
        """End the response: whatever is unfinished is aborted and freed (idempotent).

        It never waits: the source is freed synchronously and an asynchronous
        ``on_abort`` runs as a task the registry owns and bounds. So adapters call it
        in a ``finally`` even while their task is being cancelled.
        """
        self._done = True
        self._guard.close()
        await self.source.aclose()
