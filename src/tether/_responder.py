"""Responder: an adapter's ``respond()`` and ``resume()``, written once for every framework.

An adapter makes one :class:`Responder` with a :class:`Framework` (the few things
that need its framework: the request's scope, its method, headers and query, a
whole answer, a streamed one) and exports its two bound methods as its verbs, so
that both adapters take the same arguments and behave alike by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from ._batch import Batch
from ._encoders import Encoder, default_dumps
from ._exchange import Exchange, Numbered, answer_encoder, answer_whole
from ._responses import DEFAULT_SEND_TIMEOUT, JSON_HEADERS, ErrorResponse, Head
from ._scope import RequestScope
from ._stream import Stream

__all__ = ["Framework", "Responder", "Resumable"]

RequestT = TypeVar("RequestT", contravariant=True)
ResponseT = TypeVar("ResponseT", covariant=True)
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Resumable(Protocol):
    """What ``respond(..., resume=)`` and ``resume()`` need: a
    :class:`tether.resume.Resume`."""

    async def open(self, stream: Any) -> Numbered:  # (Any: a store decides what it takes)
        """Make ``stream`` resumable: the follower that answers its first request."""

    async def reconnect(
        self, headers: Mapping[str, str], query: Mapping[str, str]
    ) -> Numbered | ErrorResponse | None:
        """The follower of a reconnect, the answer that refuses it, or ``None``."""


class Framework(Protocol[RequestT, ResponseT]):
    """What a :class:`Responder` needs of a web framework."""

    def scope(self, request: RequestT) -> RequestScope:
        """The request's scope; :class:`RuntimeError` naming the install call if none."""

    def head_only(self, request: RequestT) -> bool:
        """Whether ``request`` is a HEAD request."""

    def resume_point(self, request: RequestT) -> tuple[Mapping[str, str], Mapping[str, str]]:
        """The request's headers (case-insensitive) and query parameters."""

    def whole(self, head: Head) -> ResponseT:
        """A complete, sized answer: ``head.body`` is the whole body."""

    async def streamed(self, request: RequestT, exchange: Exchange, head: Head) -> ResponseT:
        """The response that writes ``exchange`` (:meth:`Exchange.run`), from ``head``."""


class Responder(Generic[Req, Resp]):
    """``respond()`` and ``resume()`` for one framework.

    :param framework: what needs the framework.
    """

    __slots__ = ("_framework",)

    def __init__(self, framework: Framework[Req, Resp]) -> None:
        self._framework = framework

    async def respond(
        self,
        request: Req,
        source: Stream | Batch | Numbered,
        *,
        streaming: bool,
        encoder: Encoder | type[Encoder] | None = None,
        ping_interval: float = 15.0,
        headers: Mapping[str, str] | None = None,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
        resume: Resumable | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> Resp:
        """Answer ``request`` from ``source`` and close ``source`` when the response ends.

        ``streaming=False``: one JSON body, the result (a list in order for a batch):
        ``await source.result()``, which is the *last output only* unless the registry
        has a ``merge`` that folds the outputs together (or ``transform`` shapes it).
        ``streaming=True``: a streamed body framed by ``encoder`` (SSE by default), with
        a terminal frame and a ping after ``ping_interval`` seconds of silence. A
        failure before the first output gets its HTTP status and a JSON body; after it,
        one error event and the terminal frame. A ``HEAD`` request gets the headers
        only and the work is aborted.

        :param request: the request, which went through the adapter's install call.
        :param source: the stream or batch to answer with; the response owns it now.
        :param streaming: stream every output, or answer with one JSON body.
        :param encoder: the streaming framing (an :class:`tether.Encoder` or its class).
        :param ping_interval: seconds of silence after which a keep-alive is sent.
        :param headers: extra response headers; they take precedence over tether's.
        :param send_timeout: seconds one write of a stream may wait for a client that
            stopped reading before the request is aborted as if the client had left
            (its connection dropped where the framework allows); ``None``: for ever.
        :param resume: make the stream resumable (``streaming=True``, SSE, a Stream;
            see ``docs/resume.md``): a client that leaves parks it; ``resume()``
            continues it.
        :param transform: turns what is answered into the value written, with no
            round trip through JSON: ``streaming=False``, the result (a batch's: the
            list of results, in order); ``streaming=True``, each output. Its errors
            fail the request as an unencodable output does (500, or an error event).
        :raises RuntimeError: the adapter is not installed (``source`` is closed);
            ``source`` was answered already (by an earlier response, which keeps it),
            or closed.
        :raises TypeError: ``source`` is not a tether Stream or Batch.
        :raises ValueError: ``ping_interval`` or ``send_timeout`` is not positive;
            ``resume`` without ``streaming`` or with an encoder that has no event ids.
        """
        framework = self._framework
        if resume is not None:
            try:
                framework.scope(request)  # before the stream outlives the request
            except RuntimeError:
                source.cancel()
                raise
            source = await resume.open(source)  # (not a Stream: aborted, TypeError)
        elif not streaming and not framework.head_only(request):
            # One JSON body: no exchange, the answer is waited for in one frame less.
            # (bad options: the source, which the answer owns, is aborted, and it raises)
            shaped = answer_encoder(source, False, encoder, ping_interval, send_timeout, transform)
            try:
                framework.scope(request).adopt(source)
                head = await answer_whole(source, shaped)
            finally:
                await source.aclose()
            return framework.whole(_with_headers(head, headers) if headers else head)
        exchange = Exchange(  # (bad options: it aborts the source, which it owns, and raises)
            source,
            streaming=streaming,
            encoder=encoder,
            ping_interval=ping_interval,
            send_timeout=send_timeout,
            transform=transform,
        )
        try:
            # The adapter watches the client; the request's scope owns the source, even
            # one opened elsewhere (a dispatcher task, an earlier request).
            scope = framework.scope(request)
            scope.adopt(source)
            exchange.scope = scope
            head_only = framework.head_only(request)
            head = await exchange.start(head_only=head_only)
        except BaseException:
            await exchange.aclose()
            raise
        head = _with_headers(head, headers)
        if exchange.done and not head_only:
            await exchange.aclose()
            return framework.whole(head)
        streamed = framework.streamed(request, exchange, head)
        del head  # (the adapter's to keep or drop: an idle stream's frames need none of it)
        return await streamed

    async def resume(
        self,
        request: Req,
        resume: Resumable,
        *,
        encoder: Encoder | type[Encoder] | None = None,
        ping_interval: float = 15.0,
        headers: Mapping[str, str] | None = None,
        send_timeout: float | None = DEFAULT_SEND_TIMEOUT,
    ) -> Resp | None:
        """Answer a reconnect to a resumable stream (``Last-Event-ID`` or the resume
        token, see :meth:`tether.resume.Resume.reconnect`), or ``None`` if ``request`` is none.
        Call it first in a handler that answers with ``respond(..., resume=resume)``.

        :returns: the response (a 404 for a stream that is not resumable), or ``None``.
        :raises RuntimeError: the adapter is not installed.
        :raises tether.Aborted: the client left while the store looked for its stream
            (the adapter answers it, with no one to read it).
        """
        framework = self._framework
        framework.scope(request)  # (the follower joins the request's scope)
        found = await resume.reconnect(*framework.resume_point(request))
        if found is None:
            return None
        if not isinstance(found, Numbered):
            body = default_dumps(found.body)
            return framework.whole(Head(found.status, {**JSON_HEADERS, **found.headers}, body))
        return await self.respond(
            request,
            found,
            streaming=True,
            encoder=encoder,
            ping_interval=ping_interval,
            headers=headers,
            send_timeout=send_timeout,
        )


def _with_headers(head: Head, headers: Mapping[str, str] | None) -> Head:
    """``head`` with the extra ``headers`` of ``respond()``, which take precedence."""
    if not headers:
        return head
    extra = {name.lower(): value for name, value in headers.items()}
    return Head(head.status, {**head.headers, **extra}, head.body)
