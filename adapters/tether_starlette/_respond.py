"""respond(): answer a Starlette request from a tether ``Stream`` or ``Batch``.

Every HTTP decision (the status, which waits for the first output; the framing;
pings; one error event and the terminal frame after a late failure) is
:class:`tether.http.Exchange`'s. This module only moves its bytes: a complete answer
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
cancellation goes on: the work is aborted, and :meth:`tether.http.Exchange.farewell`
(one error event, 503: the server ended the request, and the terminal frame) goes
out in a last ``http.response.body`` (``more_body`` false); then ``CancelledError``
is raised again, never swallowed. uvicorn's ``send`` still writes after the
cancellation (its only wait is for flow control, and a message is written after it),
so the client gets a whole stream; that last write is bounded by
``FAREWELL_TIMEOUT``, since a client that stopped reading would hold it for ever.
(A JSON wait cancelled the same way is answered by the middleware.)
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

import tether
from tether.http import (
    DEFAULT_SEND_TIMEOUT,
    FAREWELL_TIMEOUT,
    Exchange,
    Follower,
    Head,
)

from ._middleware import request_scope

__all__ = ["ExchangeResponse", "respond", "resume"]

logger = logging.getLogger("tether.starlette")


async def respond(
    request: Request,
    source: tether.Stream | tether.Batch | Follower,
    *,
    streaming: bool,
    encoder: tether.Encoder | type[tether.Encoder] | None = None,
    ping_interval: float = 15.0,
    headers: Mapping[str, str] | None = None,
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
    resume: tether.Resume | None = None,
    transform: Callable[[Any], Any] | None = None,
) -> Response:
    """Answer ``request`` from ``source`` and close ``source`` when the response ends.

    ``streaming=False``: one JSON body, the result (a list in order for a batch):
    ``await source.result()``, which is the *last output only* unless the registry
    has a ``merge`` that folds the outputs together (or ``transform`` shapes it).
    ``streaming=True``: a streamed body framed by ``encoder`` (SSE by default), with a
    terminal frame and a ping after ``ping_interval`` seconds of silence. A failure
    before the first output gets its HTTP status and a JSON body; after it, one error
    event and the terminal frame. A ``HEAD`` request gets the headers only and the
    work is aborted.

    :param request: the request, which went through :class:`TetherMiddleware`.
    :param source: the stream or batch to answer with; the response owns it from now on.
    :param streaming: stream every output, or answer with one JSON body.
    :param encoder: the streaming framing (an :class:`tether.Encoder` or its class).
    :param ping_interval: seconds of silence after which a keep-alive is sent.
    :param headers: extra response headers; they take precedence over tether's.
    :param send_timeout: seconds one write of a stream may wait for a client that
        stopped reading before the request is aborted as if the client had left;
        ``None`` waits for ever.
    :param resume: make the stream resumable (``streaming=True``, SSE, a Stream; see
        ``docs/resume.md``): a client that leaves parks it; :func:`resume` continues it.
    :param transform: turns what is answered into the value written, with no round
        trip through JSON: ``streaming=False``, the result (a batch's: the list of
        results, in order); ``streaming=True``, each output. Its errors fail the
        request as an unencodable output does (500, or an error event).
    :raises RuntimeError: :class:`TetherMiddleware` is not installed (``source`` is closed).
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
    if transform is not None:
        encoder = _shaped(encoder, transform, streaming=streaming)
    exchange = Exchange(  # (bad options: it aborts the source, which it owns, and raises)
        source,
        streaming=streaming,
        encoder=encoder,
        ping_interval=ping_interval,
        send_timeout=send_timeout,
    )
    try:
        # The middleware watches the client; the request's scope owns the source, even
        # one opened elsewhere (a dispatcher task, an earlier request).
        request_scope(request).adopt(source)
        head_only = request.method == "HEAD"
        head = await (exchange.start_head_only() if head_only else exchange.start())
    except BaseException:
        await exchange.aclose()
        raise
    extra = {name.lower(): value for name, value in (headers or {}).items()}
    if exchange.done and not head_only:  # (HEAD: a Response would say Content-Length: 0)
        await exchange.aclose()
        return Response(head.body, head.status, headers={**head.headers, **extra})
    return ExchangeResponse(exchange, head, extra)


async def resume(
    request: Request,
    resume: tether.Resume,
    *,
    encoder: tether.Encoder | type[tether.Encoder] | None = None,
    ping_interval: float = 15.0,
    headers: Mapping[str, str] | None = None,
    send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
) -> Response | None:
    """Answer a reconnect to a resumable stream (``Last-Event-ID`` or the resume token,
    see :meth:`tether.Resume.reconnect`), or ``None`` if ``request`` is none. Call it
    first in a handler that answers with ``respond(..., resume=resume)``.

    :returns: the response (a 404 for a stream that is not resumable), or ``None``.
    :raises RuntimeError: :class:`TetherMiddleware` is not installed.
    """
    request_scope(request)  # (the follower joins the request's scope)
    found = await resume.reconnect(request.headers, request.query_params)
    if not isinstance(found, Follower):
        if found is None:
            return None
        return JSONResponse(found.body, found.status, headers=found.headers)
    return await respond(
        request,
        found,
        streaming=True,
        encoder=encoder,
        ping_interval=ping_interval,
        headers=headers,
        send_timeout=send_timeout,
    )


def _shaped(
    encoder: tether.Encoder | type[tether.Encoder] | None,
    transform: Callable[[Any], Any],
    *,
    streaming: bool,
) -> tether.Encoder:
    """``encoder`` with ``transform`` applied to each output (streaming), or to the
    result before it is serialised (one JSON body, which the exchange writes with
    the encoder's ``dumps``)."""
    base = tether.SSE() if encoder is None else encoder() if isinstance(encoder, type) else encoder
    if streaming:
        return base.shaped(transform)
    shaped = copy.copy(base)
    dumps = base.dumps
    shaped.dumps = lambda result: dumps(transform(result))
    return shaped


class ExchangeResponse(Response):
    """A streaming response that sends what a :class:`tether.http.Exchange` gives.

    Built by :func:`respond` once the exchange has started: the status and headers
    are known, and ``head.body`` is the first chunk. Each later chunk (every output
    ready at that moment) goes out in one message; the source is closed when the
    response ends, however it ends.

    :param exchange: the started exchange; the response owns it.
    :param head: what ``exchange.start()`` returned.
    :param headers: extra headers (lower-case names) laid over the head's.
    """

    def __init__(self, exchange: Exchange, head: Head, headers: dict[str, str]) -> None:
        self.exchange = exchange
        self.status_code = head.status
        self.background = None
        self._first = head.body
        self.init_headers({**head.headers, **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = self.exchange
        started = last = False
        body = b""  # the body of the message being sent, until its send returns
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            if not await exchange.bounded(send({**start, "headers": self.raw_headers})):
                return
            started = True
            body = self._first
            # The hot loop: per chunk, one send and (only when nothing is ready) one
            # wait; the send timeout is bookkeeping around the send, not a coroutine.
            writing, written, ready_chunk = exchange.writing, exchange.written, exchange.ready_chunk
            wait, ping_interval = exchange.source.wait_ready, exchange.ping_interval
            while True:
                last = exchange.done
                writing()
                await send({"type": "http.response.body", "body": body, "more_body": not last})
                written()
                if last:
                    break
                body = b""
                chunk = ready_chunk()
                if chunk is None:
                    await wait(timeout=ping_interval)
                    chunk = exchange.waited_chunk()
                body = chunk
        except asyncio.CancelledError:
            if started and exchange.stalled():
                return  # the client read nothing for send_timeout: it counts as gone
            await _farewell(exchange, send, started, body, last)
            raise
        finally:
            await exchange.aclose()
        if self.background is not None:
            await self.background()


async def _farewell(
    exchange: Exchange, send: Send, started: bool, unsent: bytes, last: bool
) -> None:
    """End the response of a cancelled task (a server abort), best effort and bounded.

    A cancelled send wrote nothing under uvicorn (it is cancelled in its wait for flow
    control, before writing), so ``unsent`` goes out again ahead of the rest.
    """
    try:
        async with asyncio.timeout(FAREWELL_TIMEOUT):
            if not started:
                head = exchange.farewell_head()
                raw = [(name.encode(), value.encode()) for name, value in head.headers.items()]
                await send({"type": "http.response.start", "status": head.status, "headers": raw})
                body = head.body
            else:
                body = unsent if last else unsent + exchange.farewell()
            await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception as exc:  # best effort: the cancellation is what goes on
        logger.debug("%r: the end of a cancelled response was not sent: %r", exchange.source, exc)
