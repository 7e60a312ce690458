"""respond(): answer a Starlette request from a tether ``Stream`` or ``Batch``.

Every HTTP decision (the status, which waits for the first output; the framing;
pings; one error event and the terminal frame after a late failure) is
:class:`tether.Exchange`'s. This module only moves its bytes: a complete answer
becomes a plain :class:`~starlette.responses.Response`, a stream becomes an
:class:`ExchangeResponse` that sends every chunk the exchange gives in one
``http.response.body`` message. Whatever happens (the end, an error, a client
disconnect, the task being cancelled) the source is closed explicitly with a
wait that cannot block (``Exchange.aclose``): nothing is left to a generator's
finaliser.

A client that stops reading without closing its connection blocks the server's
writes (flow control). Each ``send`` of a stream is bounded by the exchange's
``send_timeout``; past it the client counts as gone: the request's scope is
disconnected (the work is aborted and freed) and the response ends unfinished,
which makes uvicorn close the connection. (ASGI gives the app no way to drop the
connection at once: uvicorn's close still waits for the peer to take the bytes
already queued, or to go.) A plain JSON answer is one ``send`` issued after its
request finished, so nothing waits on it.

A stream whose task is cancelled (uvicorn does so to the requests still running
when its graceful-shutdown timeout ends) still ends its response before the
cancellation goes on: the work is aborted (reason ``cancelled``), and what was
ready goes out with one error event (503: the server ended the request) and the
terminal frame in a last ``http.response.body`` (``more_body`` false); then
``CancelledError`` is raised again, never swallowed.
uvicorn's ``send`` still writes after the cancellation (its only wait is for flow
control, and a message is written after it), so the client gets a whole stream;
that last write is bounded by :data:`FAREWELL_TIMEOUT`, since a client that
stopped reading would hold it for ever. uvicorn then logs the cancellation as an
error, as it does for any exception an app raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

import tether

__all__ = ["ExchangeResponse", "respond"]

logger = logging.getLogger("tether")

FAREWELL_TIMEOUT: Final = 1.0
"""Seconds the last write of a cancelled stream may take (its error event and
terminal frame): enough for a client that reads, short for one that stopped."""


async def respond(
    request: Request,
    source: tether.Stream | tether.Batch,
    *,
    streaming: bool,
    encoder: tether.Encoder | type[tether.Encoder] | None = None,
    ping_interval: float = 15.0,
    headers: Mapping[str, str] | None = None,
    send_timeout: float | None = tether.DEFAULT_SEND_TIMEOUT,
) -> Response:
    """Answer ``request`` with ``source``: one JSON body, or a stream of events.

    Waits until the status is known (the result, or the first output or ping of a
    stream), so a failure before that gets its real status and a JSON error body.
    A HEAD request gets the headers only, and its work is aborted at once.

    :param request: the request being answered.
    :param source: the stream or batch to answer with; the response owns it from now on.
    :param streaming: stream every output (``True``) or answer with the result as JSON
        (a list, in order, for a batch).
    :param encoder: the stream's framing: :class:`tether.SSE` (default) or
        :class:`tether.NDJSON`, a class or an instance.
    :param ping_interval: seconds of silence after which the stream sends a keep-alive.
    :param headers: extra response headers.
    :param send_timeout: seconds one write of a stream may wait for a client that
        stopped reading before the request is aborted as if the client had left;
        ``None`` waits for ever.
    :raises RuntimeError: :class:`TetherMiddleware` is not installed (``source`` is closed).
    :raises ValueError: ``ping_interval`` or ``send_timeout`` is not positive.
    """
    try:
        exchange = tether.Exchange(
            source,
            streaming=streaming,
            encoder=encoder,
            ping_interval=ping_interval,
            send_timeout=send_timeout,
        )
    except ValueError:  # bad options: the response owned the source all the same
        await source.aclose()
        raise
    try:
        # The same lookup registry.open() makes to adopt the stream: when it finds the
        # middleware's scope, that scope owns the stream and watches the client.
        if tether.RequestScope.current() is None:
            raise RuntimeError(
                "respond() needs TetherMiddleware, which notices client disconnects and "
                "closes each request's streams: add it with "
                "app.add_middleware(TetherMiddleware, registry=registry)"
            )
        head_only = request.method == "HEAD"
        head = await (exchange.start_head_only() if head_only else exchange.start())
    except BaseException:
        await exchange.aclose()
        raise
    extra = {name.lower(): value for name, value in (headers or {}).items()}
    if head.more or head_only:  # (HEAD: a plain Response would say Content-Length: 0)
        return ExchangeResponse(exchange, head, extra)
    await exchange.aclose()
    return Response(head.body, head.status, headers={**head.headers, **extra})


class ExchangeResponse(Response):
    """A streaming response that sends what a :class:`tether.Exchange` gives.

    Built by :func:`respond` once the exchange has started: the status and headers
    are known, and ``head.body`` is the first chunk. Each later chunk (every output
    ready at that moment) goes out in one message; the source is closed when the
    response ends, however it ends.

    :param exchange: the started exchange; the response owns it.
    :param head: what ``exchange.start()`` returned.
    :param headers: extra headers (lower-case names) laid over the head's.
    """

    def __init__(
        self, exchange: tether.Exchange, head: tether.Head, headers: dict[str, str]
    ) -> None:
        self.exchange = exchange
        self.status_code = head.status
        self.background = None
        self._first = head.body
        self._more = head.more
        self.init_headers({**head.headers, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = self.exchange
        started = False
        body = b""  # the body of the message being sent, until its send returns
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            if not await exchange.bounded(send({**start, "headers": self.raw_headers})):
                return
            started = True
            body, more = self._first, self._more
            while True:
                message = {"type": "http.response.body", "body": body, "more_body": more}
                if not await exchange.bounded(send(message)) or not more:
                    break
                body = b""
                chunk = await exchange.next_chunk()
                body, more = chunk or b"", chunk is not None and not exchange.done
        except asyncio.CancelledError:
            await self._farewell(scope, receive, send, started, body)
            raise
        finally:
            await exchange.aclose()
        if self.background is not None:
            await self.background()

    async def _farewell(
        self, scope: Scope, receive: Receive, send: Send, started: bool, unsent: bytes
    ) -> None:
        """End the response of a cancelled task as a server abort, best effort and bounded.

        A cancelled send wrote nothing under uvicorn (it is cancelled in its wait for
        flow control, before writing), so ``unsent`` goes out again ahead of the rest.
        """
        exchange = self.exchange
        try:
            async with asyncio.timeout(FAREWELL_TIMEOUT):
                if not started:
                    exchange.source.cancel(tether.AbortReason.CANCELLED)
                    error = tether.error_response(_server_abort(exchange.source))
                    answer = JSONResponse(error.body, error.status, headers=error.headers)
                    await answer(scope, receive, send)
                    return
                body = unsent + await _rest_of_cancelled(exchange)
                await send({"type": "http.response.body", "body": body, "more_body": False})
        except Exception as exc:  # best effort: the cancellation is what goes on
            logger.debug(
                "%r: the end of a cancelled response was not sent: %r", exchange.source, exc
            )


def _server_abort(source: tether.Stream | tether.Batch) -> tether.Aborted:
    """What a client is told of a request whose handler the server cancelled."""
    rid = source.rid if isinstance(source, tether.Stream) else source.rids[0]
    return tether.Aborted(rid, tether.AbortReason.SERVER)


async def _rest_of_cancelled(exchange: tether.Exchange) -> bytes:
    """The rest of a stream whose task was cancelled, without waiting: what was ready,
    then one error event and the terminal frame (or just the terminal frame, if the
    stream had finished).

    The cancelled wait already aborted the source (reason ``cancelled``), which the
    exchange ends quietly, as for a client that left; but this client is still there
    and is told why its stream ends.
    """
    exchange.source.cancel(tether.AbortReason.CANCELLED)  # (when cancelled in a write)
    encoder = exchange.encoder
    chunks = []
    while not exchange.done:
        chunk = await exchange.next_chunk()
        if chunk is None:
            error = tether.error_response(_server_abort(exchange.source))
            chunk = encoder.error(error.body) + encoder.terminal()
        chunks.append(chunk)
    return b"".join(chunks)
