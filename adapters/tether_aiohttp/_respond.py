"""respond() and resume() for aiohttp (:class:`tether.http.Responder`'s), writing through
aiohttp's ``write()`` (it waits for flow control) or, with no bytes held, straight to the
transport (:class:`_Direct`, from the producer's step). A client that stopped reading for
the send timeout is dropped at once; a write cut by cancellation went out: no farewell."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping

from aiohttp import hdrs, web

from tether.http import Exchange, Head, Responder

from ._plugin import answer_scope

__all__ = ["respond", "resume"]


class _Aiohttp:  # what tether.http.Responder needs of aiohttp
    __slots__ = ()

    scope = staticmethod(answer_scope)  # (a request gets one response)

    def head_only(self, request: web.Request) -> bool:
        return request.method == hdrs.METH_HEAD

    def resume_point(self, request: web.Request) -> tuple[Mapping[str, str], Mapping[str, str]]:
        return request.headers, request.query

    def whole(self, head: Head) -> web.Response:
        return web.Response(status=head.status, body=head.body or None, headers=head.headers)

    async def streamed(
        self, request: web.Request, exchange: Exchange, head: Head
    ) -> web.StreamResponse:
        if exchange.done:  # HEAD: the headers alone
            return self.whole(head)
        response = _Streamed(status=head.status, headers=head.headers)
        run = exchange.run(_Writer(request, response), head.body)
        del head  # (copied into the response: an idle stream's frames keep none of it)
        await run
        return response


class _Streamed(web.StreamResponse):
    _send_headers_immediately = False  # (the head goes with the first chunk: one send)


_RESPONDER = Responder(_Aiohttp())
respond = _RESPONDER.respond
resume = _RESPONDER.resume


class _Writer:
    """A :class:`~aiohttp.web.StreamResponse` as :meth:`tether.http.Exchange.run`'s writer."""

    __slots__ = ("_request", "_response")

    lost_when_cut = False

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self._response = response

    def start(self) -> Awaitable[object]:
        return self._response.prepare(self._request)

    def write(self, chunk: bytes, last: bool) -> Awaitable[None]:
        return self._response.write_eof(chunk) if last else self._response.write(chunk)

    async def answer(self, head: Head) -> None:
        response = self._response
        if response.prepared:  # (a start cut after its head went out)
            await response.write_eof()
            return
        response = web.Response(status=head.status, body=head.body, headers=head.headers)
        await response.prepare(self._request)
        await response.write_eof()

    def drop(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()

    def direct(self) -> _Direct | None:
        """A direct writer once prepared, or ``None`` if the body is framed otherwise
        (HTTP/1.0, compression, a length set by a signal handler)."""
        transport, response = self._request.transport, self._response
        if (
            # duck-typed: uvloop's transport (how aiohttp is deployed) subclasses no asyncio's
            transport is None
            or not all(
                hasattr(transport, c) for c in ("write", "get_write_buffer_size", "is_closing")
            )
            or response.compression
            or response.content_length is not None
            or response.headers.get(hdrs.TRANSFER_ENCODING) != "chunked"
        ):
            return None
        return _Direct(transport)


class _Direct:
    """Writes a chunk of a started response straight to its transport when nothing is
    queued before it (flow control has not paused writing) and the connection is open.
    This and aiohttp's writer end in the same ``transport.write``, in program order: bytes
    keep their order (aiohttp's byte count, the access log's ``%b``, misses these)."""

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def writable(self) -> bool:
        transport = self._transport
        return not transport.get_write_buffer_size() and not transport.is_closing()

    def write(self, chunk: bytes) -> bool:
        transport = self._transport
        if transport.get_write_buffer_size() or transport.is_closing():
            return False
        if chunk:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True
