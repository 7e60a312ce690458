"""respond(): one aiohttp response from a tether Stream or Batch.

The HTTP policy (the status waits for the first output, framing, pings, one error
event and the terminal frame after the start) is :class:`tether.http.Exchange`'s; this
module only moves its bytes, one ``write()`` per chunk (a chunk already holds every
output that was ready). A write that fails means the client left: the request's
scope is told, and the response ends quietly, since nobody reads an error event.

A client that stops reading without closing its connection blocks ``write()``
(flow control). Each write of a stream is bounded by the exchange's
``send_timeout``; past it the client counts as gone: the scope is told (the work
is aborted and freed) and the connection is dropped at once, so that aiohttp
does not wait on it again when it finishes the response. A plain JSON answer is
written by aiohttp after its request finished, so nothing waits on it.

Writing from the producer's step. While a stream's handler waits with nothing in
flight and its transport holds no bytes (so flow control has not paused it), the
stream's sink (``Stream.set_sink``) writes each output the producer delivers
straight to the transport, inside ``deliver()``: no wake-up of the handler's task
per output. The task still wakes for the end, an error, a ping, or once the
transport holds bytes back; it then writes through aiohttp's ``write()`` (which
waits for flow control, bounded by ``send_timeout``), in order, until the transport
is idle again.

A handler cancelled while its client is still connected (``handler_cancellation``
on, or the end of ``shutdown_timeout``) ends its response before the cancellation
goes on: the work is aborted, and the client, told that the server ended its
request (503), gets :meth:`tether.http.Exchange.farewell_head` (nothing sent yet)
or :meth:`~tether.http.Exchange.farewell` (a stream: one error event and the
terminal frame), written within ``FAREWELL_TIMEOUT``; then ``CancelledError`` is
raised again, never swallowed (aiohttp logs it at debug level only). A handler
cancelled because its client left writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import hdrs, web
from multidict import CIMultiDict

import tether
from tether.http import (
    DEFAULT_SEND_TIMEOUT,
    FAREWELL_TIMEOUT,
    Exchange,
    Follower,
)

from ._plugin import request_scope

__all__ = ["respond", "resume"]

logger = logging.getLogger("tether.aiohttp")


async def respond(
    request: web.Request,
    source: tether.Stream | tether.Batch | Follower,
    *,
    streaming: bool,
    encoder: tether.Encoder | type[tether.Encoder] | None = None,
    ping_interval: float = 15.0,
    headers: Mapping[str, str] | None = None,
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
    resume: tether.Resume | None = None,
) -> web.StreamResponse:
    """Answer ``request`` from ``source`` and close ``source`` when the response ends.

    ``streaming=False``: one JSON body, the result (a list in order for a batch).
    ``streaming=True``: a streamed body framed by ``encoder`` (SSE by default), with a
    terminal frame and a ping after ``ping_interval`` seconds of silence. A failure
    before the first output gets its HTTP status and a JSON body; after it, one error
    event and the terminal frame. A ``HEAD`` request gets the headers only and the
    work is aborted.

    :param request: the request, which went through the middleware of ``setup()``.
    :param source: the stream or batch to answer with; the response owns it from now on.
    :param streaming: stream every output, or answer with one JSON body.
    :param encoder: the streaming framing (an :class:`tether.Encoder` or its class).
    :param ping_interval: seconds of silence after which a keep-alive is sent.
    :param headers: extra response headers; they take precedence over tether's.
    :param send_timeout: seconds one write of a stream may wait for a client that
        stopped reading before the request is aborted as if the client had left and
        its connection dropped; ``None`` waits for ever.
    :param resume: make the stream resumable (``streaming=True``, SSE, a Stream; see
        ``docs/resume.md``): a client that leaves parks it; :func:`resume` continues it.
    :raises RuntimeError: ``tether_aiohttp.setup(app, ...)`` was not called.
    :raises TypeError: ``source`` is not a tether Stream or Batch.
    :raises ValueError: ``ping_interval`` or ``send_timeout`` is not positive; ``resume``
        without ``streaming`` or with an encoder that has no event ids.
    """
    if resume is not None:
        try:
            request_scope(request)  # before the stream outlives the request: checked now
        except RuntimeError:
            source.cancel()
            raise
        source = await resume.open(source)  # (not a Stream: aborted, TypeError)
    exchange = Exchange(  # (bad options: it aborts the source, which it owns, and raises)
        source,
        streaming=streaming,
        encoder=encoder,
        ping_interval=ping_interval,
        send_timeout=send_timeout,
    )
    response: web.StreamResponse | None = None
    try:
        # The middleware watches the client; the request's scope owns the source, even
        # one opened elsewhere (a dispatcher task, an earlier request).
        scope = request_scope(request)
        scope.adopt(source)
        head_only = request.method == hdrs.METH_HEAD
        head = await (exchange.start_head_only() if head_only else exchange.start())
        merged = _headers(head.headers, headers)
        if head_only:
            return web.Response(headers=merged)
        if exchange.done:
            return web.Response(status=head.status, body=head.body, headers=merged)
        response = web.StreamResponse(status=head.status, headers=merged)
        return await _stream(request, scope, response, exchange, head.body)
    except asyncio.CancelledError:
        await _farewell(request, response, exchange)
        raise
    finally:
        await exchange.aclose()


async def resume(
    request: web.Request,
    resume: tether.Resume,
    *,
    encoder: tether.Encoder | type[tether.Encoder] | None = None,
    ping_interval: float = 15.0,
    headers: Mapping[str, str] | None = None,
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
) -> web.StreamResponse | None:
    """Answer a reconnect to a resumable stream (``Last-Event-ID`` or the resume token,
    see :meth:`tether.Resume.reconnect`), or ``None`` if ``request`` is none. Call it
    first in a handler that answers with ``respond(..., resume=resume)``.

    :returns: the response (a 404 for a stream that is not resumable), or ``None``.
    :raises RuntimeError: ``tether_aiohttp.setup(app, ...)`` was not called.
    """
    request_scope(request)  # (the follower joins the request's scope)
    found = await resume.reconnect(request.headers, request.query)
    if not isinstance(found, Follower):
        if found is None:
            return None
        return web.json_response(found.body, status=found.status, headers=found.headers)
    return await respond(
        request,
        found,
        streaming=True,
        encoder=encoder,
        ping_interval=ping_interval,
        headers=headers,
        send_timeout=send_timeout,
    )


async def _stream(
    request: web.Request,
    scope: tether.RequestScope,
    response: web.StreamResponse,
    exchange: Exchange,
    first: bytes,
) -> web.StreamResponse:
    """Write the whole stream, each write bounded by the send timeout. A client that
    stalled has its connection dropped, so that aiohttp does not wait on it again
    when it finishes the response. (One coroutine frame: an idle stream holds it
    for as long as it lasts.)"""
    whole = False
    try:
        if await exchange.bounded(response.prepare(request)):
            # The first chunk goes through aiohttp's writer, which sends the head if it
            # is still buffered; after it, a chunk may go straight to the transport.
            direct = _Direct.of(request, response, exchange)
            # The hot loop: per chunk, one write and (only when nothing is ready) one
            # wait; the send timeout is bookkeeping around a write that may wait.
            writing, written = exchange.writing, exchange.written
            ready_chunk, source = exchange.ready_chunk, exchange.source
            wait, ping_interval = source.wait_ready, exchange.ping_interval
            # (a batch read whole, or a resumable stream's follower: the usual way)
            stream = source if isinstance(source, tether.Stream) else None
            write = response.write
            chunk = first
            first_write = True
            while not exchange.done:
                if first_write or direct is None or not direct.write(chunk):
                    first_write = False
                    writing()
                    await write(chunk)
                    written()
                ready = ready_chunk()
                if ready is None:
                    if (
                        stream is not None
                        and direct is not None
                        and direct.writable()
                        and stream.set_sink(direct.sink)
                    ):
                        # Parked with nothing in flight on an idle transport: the
                        # producer's step writes what it delivers (_Direct.sink); this
                        # task wakes for the end, an error, a ping, or once the
                        # transport holds bytes back.
                        ready = await direct.parked(stream, ready_chunk, ping_interval)
                    else:
                        await wait(timeout=ping_interval)
                    if ready is None:
                        ready = exchange.waited_chunk()
                chunk = ready
            # The last chunk and the end of the body (the empty chunk) in one write.
            whole = await exchange.bounded(response.write_eof(chunk))
    except ConnectionError:  # aiohttp's ClientConnectionResetError among them
        scope.disconnect()
        return response
    except asyncio.CancelledError:
        if not exchange.stalled():
            raise  # someone else's: respond() says farewell
        # (the send timeout cut a write: the client read nothing for it, it counts as gone)
    if not whole:
        # The client stopped reading (the exchange told the scope): drop the connection.
        transport = request.transport
        if transport is not None:
            transport.abort()
    return response


class _Direct:
    """Writes a chunk of a started response straight to its transport when that
    cannot wait: nothing is queued before it (so flow control has not paused
    writing), the connection is open, and the body is plain chunked encoding (no
    compression, no length). Otherwise the caller writes through aiohttp's
    ``StreamResponse.write``, which waits for flow control. Both end in the same
    ``transport.write``, in program order, so switching between them keeps the
    bytes in order.

    Per event this skips aiohttp's writer layers and the send timeout's bookkeeping
    (a write that cannot wait needs no bound). aiohttp's own byte count of the
    response (``body_length``, the access log's ``%b``) misses these bytes.
    """

    __slots__ = ("_exchange", "_now", "_sunk_at", "_transport")

    def __init__(self, transport: asyncio.Transport, exchange: Exchange) -> None:
        self._transport = transport
        self._exchange = exchange
        self._now = asyncio.get_running_loop().time
        self._sunk_at: float | None = None  # when the sink last wrote (the loop's time)

    @classmethod
    def of(
        cls, request: web.Request, response: web.StreamResponse, exchange: Exchange
    ) -> _Direct | None:
        """A direct writer for ``response`` once prepared, or ``None`` if its body is
        framed otherwise (HTTP/1.0, compression, a length set by a signal handler)."""
        transport = request.transport
        if (
            not isinstance(transport, asyncio.Transport)
            or response.compression
            or response.content_length is not None
            or response.headers.get(hdrs.TRANSFER_ENCODING) != "chunked"
        ):
            return None
        return cls(transport, exchange)

    def _last_write(self) -> float | None:
        """When the sink last wrote (the loop's time) since this was last asked, if it did."""
        sunk_at, self._sunk_at = self._sunk_at, None
        return sunk_at

    async def parked(
        self, stream: tether.Stream, ready_chunk: Callable[[], bytes | None], interval: float
    ) -> bytes | None:
        """Wait while :meth:`sink` (set on ``stream`` by the caller, removed here) writes:
        what is ready once the task is woken, or ``None`` when a keep-alive is due,
        after ``interval`` of silence since the sink's last write (not since parking)."""
        self._last_write()  # (earlier writes do not count)
        timeout = interval
        try:
            while True:
                await stream.wait_ready(timeout=timeout)
                ready = ready_chunk()
                sunk_at = self._last_write()
                if ready is not None or sunk_at is None:
                    return ready
                timeout = sunk_at + interval - self._now()
                if timeout <= 0:
                    return None
        finally:
            stream.set_sink(None)

    def writable(self) -> bool:
        """Whether a write now goes out without waiting (nothing queued, still open)."""
        transport = self._transport
        return not transport.get_write_buffer_size() and not transport.is_closing()

    def write(self, chunk: bytes) -> bool:
        """Write ``chunk`` as one HTTP chunk if the transport is :meth:`writable`;
        ``False`` (nothing written) if not."""
        transport = self._transport
        if transport.get_write_buffer_size() or transport.is_closing():
            return False
        if chunk:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    def sink(self, outputs: list[Any]) -> bool:
        """The stream's sink (``Stream.set_sink``), called in the producer's step with
        what it delivered: write it now if the transport is still :meth:`writable`;
        ``False`` (nothing written) hands it back to the handler's task, which goes
        on through aiohttp's writer, in order."""
        transport = self._transport
        if transport.get_write_buffer_size() or transport.is_closing():
            return False
        chunk = self._exchange.sink_chunk(outputs)
        if chunk is None:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        self._sunk_at = self._now()
        return True


async def _farewell(
    request: web.Request, response: web.StreamResponse | None, exchange: Exchange
) -> None:
    """End the response of a cancelled handler (a server abort), best effort and bounded.

    (aiohttp writes before it waits for flow control: a cancelled write went out.)
    """
    transport = request.transport
    if transport is None or transport.is_closing():
        exchange.source.cancel(tether.AbortReason.CANCELLED)
        return  # the client left (handler_cancellation): nobody reads an answer
    try:
        async with asyncio.timeout(FAREWELL_TIMEOUT):
            if response is None or not response.prepared:
                head = exchange.farewell_head()
                response = web.Response(status=head.status, body=head.body, headers=head.headers)
                await response.prepare(request)
            elif not exchange.done:
                await response.write(exchange.farewell())
            await response.write_eof()
    except Exception as exc:  # best effort: the cancellation is what goes on
        logger.debug("%r: the end of a cancelled response was not sent: %r", exchange.source, exc)


def _headers(
    base: Mapping[str, str], extra: Mapping[str, str] | None
) -> Mapping[str, str] | CIMultiDict[str]:
    """``base`` with ``extra`` laid over it (aiohttp copies what it is given: with no
    ``extra``, ``base`` goes as it is)."""
    if not extra:
        return base
    merged = CIMultiDict(base)
    merged.update(extra)
    return merged
