"""Installing tether in a Starlette (or FastAPI) app: :class:`TetherMiddleware`, pure ASGI on
purpose (``BaseHTTPMiddleware`` hides disconnects). Per HTTP request: a :class:`tether.RequestScope`
marked in the ASGI scope (:data:`SCOPE_KEY`, not judged by the context: uvicorn starts a pipelined
request in the previous one's ``send()``), the one reader of ``receive``, the error answers."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Final, Literal, TypeVar

from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tether import http

__all__ = ["DRAIN_KEY", "READ_AHEAD", "REGISTRY_KEY", "SCOPE_KEY", "WRITES_KEY", "TetherMiddleware"]

REGISTRY_KEY: Final = "tether.registry"
"""The ASGI scope key of the middleware's registry, for handlers."""

SCOPE_KEY: Final = "tether.scope"
"""The ASGI scope key of the request's :class:`tether.RequestScope`."""

WRITES_KEY: Final = "tether.producer_writes"
"""The ASGI scope key saying whether the producer's ``deliver()`` may drive ``send``."""

DRAIN_KEY: Final = "tether.drain"
"""The lifespan scope key of its :class:`tether.http.DrainOnSignal`, once chained."""

READ_AHEAD: Final = 64 * 1024
"""Bytes of body read ahead for the app; past it the server's flow control holds on."""

logger = logging.getLogger("tether.starlette")

T = TypeVar("T")

_NOT_INSTALLED: Final = (
    "tether needs TetherMiddleware, which notices client disconnects and closes each "
    "request's streams: add it with app.add_middleware(TetherMiddleware, registry=registry)"
)


def get_registry(request: HTTPConnection) -> tether.Registry:
    """The registry given to :class:`TetherMiddleware` (``RuntimeError`` if none)."""
    return _installed(request, REGISTRY_KEY, tether.Registry)


def request_scope(request: HTTPConnection) -> tether.RequestScope:
    """The scope the middleware opened for ``request`` (``RuntimeError`` if none)."""
    return _installed(request, SCOPE_KEY, tether.RequestScope)


def _installed(request: HTTPConnection, key: str, kind: type[T]) -> T:
    found = request.scope.get(key)
    if not isinstance(found, kind):
        raise RuntimeError(_NOT_INSTALLED)
    return found


def _on_asyncio() -> bool:
    try:
        return asyncio.get_running_loop() is not None
    except RuntimeError:
        raise RuntimeError(
            "TetherMiddleware needs an asyncio event loop, and this app runs on another "
            "(trio?): run the server on asyncio (uvicorn's loop, or hypercorn -k asyncio)"
        ) from None


def _repeat(item: Message | Exception) -> Message:
    if isinstance(item, Exception):
        raise item
    return item


class TetherMiddleware:
    """Gives every HTTP request a :class:`tether.RequestScope` and client-disconnect
    detection: ``app.add_middleware(TetherMiddleware, registry=...)``. Websockets pass
    through; the lifespan too, with the server's shutdown signals chained to a drain
    (:class:`tether.http.DrainOnSignal`). Installed twice, the inner one passes through.

    :param app: the ASGI app to wrap.
    :param registry: the app's registry; handlers find it with :func:`get_registry`.
    :param drain_timeout: seconds requests in flight get after the server's shutdown
        signal; ``None`` leaves the signals alone (then close with :func:`lifespan`).
    :param producer_writes: a waiting stream's outputs are sent from the producer's
        ``deliver()`` (:class:`tether.http.Stepped`), no task woken per event. Every
        ``send`` wrapper then runs outside the handler's task: off if one needs a task
        (``asyncio.timeout``, an anyio cancel scope, ``BaseHTTPMiddleware``). ``"threads"``:
        a thread's hand-over too, in its loop callback (no task: Stepped's ``callbacks``).
    :raises RuntimeError: (when called) not on asyncio; installed twice, two registries.
    """

    __slots__ = ("_on_asyncio", "app", "drain_timeout", "producer_writes", "registry")

    def __init__(
        self,
        app: ASGIApp,
        *,
        registry: tether.Registry,
        drain_timeout: float | None = 5.0,
        producer_writes: bool | Literal["threads"] = False,
    ) -> None:
        if type(producer_writes) is not bool and producer_writes != "threads":
            raise ValueError(f"producer_writes: True, False or 'threads', not {producer_writes!r}")
        self.app, self.registry, self.drain_timeout = app, registry, drain_timeout
        self.producer_writes, self._on_asyncio = producer_writes, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._on_asyncio:  # checked until it holds once: a server keeps its loop kind
            self._on_asyncio = _on_asyncio()
        # Not the current scope: the task may have inherited a finished request's.
        kind, drain = scope["type"], self.drain_timeout
        if kind == "lifespan" and drain is not None and DRAIN_KEY not in scope:
            # (once, if installed twice) the server's shutdown signal starts the drain
            hook = scope[DRAIN_KEY] = http.DrainOnSignal(self.registry, drain_timeout=drain)
            await hook.around(self.app, scope, receive, send)
            return
        if kind != "http":
            await self.app(scope, receive, send)
            return
        if SCOPE_KEY in scope:  # installed twice: the outer copy serves this request
            if scope.get(REGISTRY_KEY) is not self.registry:
                raise RuntimeError(
                    "TetherMiddleware is installed twice with two registries; "
                    "install it once, or give both the same registry"
                )
            await self.app(scope, receive, send)
            return
        app = scope.get("app")  # (read now: a mounted Starlette app puts itself there)
        scope[REGISTRY_KEY], scope[WRITES_KEY] = self.registry, self.producer_writes
        channel = _ServerLink(receive, send)
        channel.request_id = request_id = _request_id(scope)
        with tether.RequestScope(
            on_first_track=channel.watch, request_id=request_id
        ) as request_scope:
            scope[SCOPE_KEY] = channel.scope = request_scope
            try:  # (one coroutine per request: the app's answer is awaited here)
                try:
                    await self.app(scope, channel.receive, channel.send)
                except tether.TetherError as exc:
                    if channel.started:
                        raise
                    await send_whole(channel.send, http.error_head(exc))
                except asyncio.CancelledError:
                    # The server cancelled the handler (a shutdown whose grace period ran
                    # out) while it waited for its answer: the client is still there.
                    if not channel.started:
                        request_scope.close()
                        await send_whole(channel.send, http.server_ended())
                    raise
                except Exception:
                    # Starlette's ServerErrorMiddleware answers outside, without the request
                    # id: its plain 500 goes from here, if nothing stands between (one may
                    # answer its own way) and the app has no 500 handler and no debug page.
                    stack: Any = getattr(app, "middleware_stack", None)
                    plain = isinstance(stack, ServerErrorMiddleware) and stack.handler is None
                    if plain and stack.app is self and not stack.debug and not channel.started:
                        await send_whole(channel.send, _INTERNAL_ERROR)
                    raise
            except OSError as exc:
                if exc is not channel.send_error:
                    raise
                # ASGI 2.4: the client left while the app was answering; nothing to add.
            finally:
                if (reader := channel.stop()) is not None:
                    await http.stop_tasks((reader,))


class _ServerLink:
    """One request's link to the server: it watches ``send`` and, once the scope adopts a
    stream or waits, reads ``receive`` ahead (:func:`tether.http.read_ahead`) to see the end."""

    __slots__ = (
        "_arrived",
        "_body",
        "_buffered",
        "_in_receive",
        "_last",
        "_reader",
        "_receive",
        "_room",
        "_send",
        "_wanted",
        "complete",
        "request_id",
        "scope",
        "send_error",
        "started",
    )

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive, self._send = receive, send
        self.scope: tether.RequestScope | None = None
        self.request_id: str | None = None  # echoed on the response
        self._reader: asyncio.Task[None] | http.Driven | None = None
        self._body: collections.deque[Message] = collections.deque()  # read, not yet taken
        self._buffered = 0  # bytes in _body
        # (made when first waited on: a GET that never waits for its body needs neither)
        self._arrived: asyncio.Event | None = None  # the reader's: a message or the end
        self._room: asyncio.Event | None = None  # the app's: it took a message
        self._last: Message | Exception | None = None
        self._in_receive = False  # the app is in a direct receive() now
        self._wanted = self.started = self.complete = False
        self.send_error: OSError | None = None

    def watch(self) -> None:  # the scope adopted its first stream, or waits (on_first_track)
        self._wanted = True
        if not self._in_receive:  # else the app's receive() starts it when it returns
            self._start()

    def _start(self) -> None:  # (a Task only if receive may need one: http.read_ahead)
        if self._reader is None and self._last is None:
            self._reader = http.read_ahead(self._read(), self._receive)

    def _gone(self) -> None:
        if not self.complete and self.scope is not None:
            self.scope.disconnect()

    async def _read(self) -> None:  # the body ahead of the app, then the disconnect
        receive, body = self._receive, self._body
        while True:
            while self._buffered >= READ_AHEAD:  # the app is behind: let the server hold on
                self._room = room = self._room or asyncio.Event()
                room.clear()
                await room.wait()
            try:
                message = await receive()
            except Exception as exc:  # the server's receive broke: the connection is unusable
                last: Message | Exception = exc
                break
            if message["type"] == "http.disconnect":
                last = message
                break
            if not self.started:
                body.append(message)
                self._buffered += len(message.get("body", b""))
                if self._arrived is not None:  # (an app waits for it: wake it)
                    self._arrived.set()
            # else (answered before its body was read): dropped, as Starlette does, to see the end
        self._gone()
        self._last = last
        if self._arrived is not None:
            self._arrived.set()

    def stop(self) -> asyncio.Task[None] | None:  # the request is over: a receive() still
        reader = self._reader  # waiting ends; a reader task is left to stop and await
        if reader is not None and not isinstance(reader, asyncio.Task):
            reader.close()
            reader = None
        self._last = self._last or {"type": "http.disconnect"}
        if self._arrived is not None:
            self._arrived.set()
        return reader

    async def receive(self) -> Message:  # body messages in order, then the disconnect
        if self._reader is None:
            if (last := self._last) is not None:
                return _repeat(last)
            self._in_receive = True
            try:
                message = await self._receive()
            finally:
                self._in_receive = False
                if self._wanted:  # a stream opened meanwhile: watched on, even if cancelled
                    self._start()
            if message["type"] == "http.disconnect":
                self._last = message
                self._gone()
            return message
        body = self._body
        while not body:
            if (last := self._last) is not None:
                return _repeat(last)
            self._arrived = arrived = self._arrived or asyncio.Event()
            arrived.clear()
            await arrived.wait()
        message = body.popleft()
        self._buffered -= len(message.get("body", b""))
        if self._room is not None:
            self._room.set()
        return message

    async def send(self, message: Message) -> None:  # ``OSError`` means a disconnect
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            if self.request_id is not None:
                message = _with_request_id(message, self.request_id)
            # The app answers without the rest of its body: drop it, and free a reader
            # that waits for room, so that it goes on to see the disconnect.
            self._body.clear()
            self._buffered = 0
            if self._room is not None:
                self._room.set()
        elif kind == "http.response.body" and not message.get("more_body", False):
            # Marked before sending: the server may report its own end-of-response
            # disconnect before this coroutine resumes (and wake no driven reader).
            self.complete = True
            if isinstance(self._reader, http.Driven):
                self._reader.close()
                self._reader = None  # (stop() has none to end; with _last set, none restarts)
                self._last = self._last or {"type": "http.disconnect"}
                if self._arrived is not None:
                    self._arrived.set()
        try:
            await self._send(message)
        except OSError as exc:
            self.send_error = exc
            if self.scope is not None:
                self.scope.disconnect()
            raise


_REQUEST_ID_NAME: Final = http.REQUEST_ID_HEADER.lower().encode("latin-1")


def _request_id(scope: Scope) -> str | None:  # the first one, if acceptable
    for name, value in scope.get("headers", ()):
        if name == _REQUEST_ID_NAME:
            return http.accept_request_id(value)
    return None


def _with_request_id(message: Message, request_id: str) -> Message:  # (replacing the app's)
    headers = [pair for pair in message.get("headers", ()) if pair[0].lower() != _REQUEST_ID_NAME]
    headers.append((_REQUEST_ID_NAME, request_id.encode("ascii")))
    return {**message, "headers": headers}


_TEXT: Final = {"content-type": "text/plain; charset=utf-8"}
_INTERNAL_ERROR: Final = http.Head(500, _TEXT, b"Internal Server Error")  # Starlette's own


async def send_whole(send: Send, head: http.Head) -> None:
    """Send ``head`` as a whole response, best effort, within ``FAREWELL_TIMEOUT``."""
    headers = Response(head.body, head.status, headers=head.headers).raw_headers
    try:
        async with asyncio.timeout(http.FAREWELL_TIMEOUT):
            await send({"type": "http.response.start", "status": head.status, "headers": headers})
            await send({"type": "http.response.body", "body": head.body})
    except Exception as exc:  # best effort: what goes on is the error or the cancellation
        logger.debug("the answer to a failed request was not sent: %r", exc)
