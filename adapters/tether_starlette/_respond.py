"""respond() and resume() for Starlette: :class:`tether.http.Responder`'s, a stream written
by an :class:`ExchangeResponse` (from the producer's step too: :class:`Stepped`)."""

from __future__ import annotations

from collections.abc import Awaitable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tether.http import Exchange, Head, Responder, Stepped

from ._middleware import WRITES_KEY, request_scope, send_whole

__all__ = ["ExchangeResponse", "respond", "resume"]


class _Starlette:  # what tether.http.Responder needs of Starlette
    __slots__ = ()

    scope = staticmethod(request_scope)

    def head_only(self, request: Request) -> bool:
        return request.method == "HEAD"

    def resume_point(self, request: Request) -> tuple[Mapping[str, str], Mapping[str, str]]:
        return request.headers, request.query_params

    def whole(self, head: Head) -> Response:
        return Response(head.body, head.status, headers=head.headers)

    async def streamed(self, request: Request, exchange: Exchange, head: Head) -> Response:
        # (HEAD too: a plain Response would say Content-Length: 0)
        return ExchangeResponse(exchange, head)


_RESPONDER = Responder(_Starlette())
respond = _RESPONDER.respond
resume = _RESPONDER.resume


class ExchangeResponse(Response):
    """A streaming response that owns a started :class:`tether.http.Exchange` (``head``:
    what its ``start()`` returned) and writes it through the server's ``send``."""

    lost_when_cut = True

    def __init__(self, exchange: Exchange, head: Head) -> None:
        self.exchange, self._first = exchange, head.body
        self.status_code, self.background = head.status, None
        self._send: Send  # (the server's, once it calls the response)
        self.init_headers(head.headers)
        self._start = {"type": "http.response.start", "status": head.status}
        self._start["headers"] = self.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send, self._stepped = send, scope.get(WRITES_KEY)  # (the middleware's option)
        await self.exchange.run(self, vars(self).pop("_first"))  # (not kept once written)
        if self.background is not None:  # (FastAPI's BackgroundTasks): after the answer
            await self.background()

    # The writer of Exchange.run: an ASGI send.
    def start(self) -> Awaitable[None]:
        return self._send(self._start)

    def write(self, chunk: bytes, last: bool) -> Awaitable[None]:
        return self._send({"type": "http.response.body", "body": chunk, "more_body": not last})

    async def answer(self, head: Head) -> None:
        await send_whole(self._send, head)

    def drop(self) -> None:  # uvicorn writes nothing of a cut write, drops an unfinished response
        return None

    def direct(self) -> Stepped | None:
        return Stepped(self.write, callbacks=self._stepped == "threads") if self._stepped else None
