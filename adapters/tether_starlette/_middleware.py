"""Installing tether in a Starlette (or FastAPI) app: the middleware and the lifespan.

:class:`TetherMiddleware` is pure ASGI. Around each HTTP request it opens a
:class:`tether.RequestScope` and becomes the only reader of ``receive``: an owned
reader task reads the body ahead of the app into a small bounded buffer
(:data:`READ_AHEAD` bytes, so a large body keeps the server's backpressure) and
keeps reading once the body is complete, so that an ``http.disconnect`` is seen the
moment the server reports it, whether or not the app has read its body. A
disconnect before the response is complete cancels the request's streams at once,
whether the endpoint streams or waits for one JSON result; a disconnect after it
(uvicorn sends one as soon as the response ends) is not the client leaving. On
ASGI 2.4 servers, ``send`` raising :class:`OSError` is a disconnect too.

Each request gets its own scope, marked in its ASGI scope under :data:`SCOPE_KEY`,
never judged by the context. Installed twice (two entries in the middleware list,
or an app mounted under another that has it), the inner copy finds the mark and
passes the request through: one scope, one reader; with another registry, it
refuses (``RuntimeError``), since handlers would see only one of the two. The
context is not a sign of anything: uvicorn starts a connection's next request from inside
the previous one's ``send()`` (pipelining), or from a reader callback carrying the
context of the request that last resumed reading (asyncio's loop, bodies over
64 KiB), so a task can inherit another request's :class:`tether.RequestScope`.

Departures from Starlette habits, on purpose: no ``BaseHTTPMiddleware`` (the app
behind it never sees disconnects) and no ``Request.is_disconnected()`` polling
(slow, and it eats the body when called early). A :class:`tether.TetherError` that
escapes the app before its response started (``Overloaded`` or ``RegistryClosed``
from ``registry.open()``) is answered with the status and JSON body of
:func:`tether.http.error_response`, so handlers need no ``try`` of their own. A
handler the server cancels before its response started (a shutdown whose grace
period ran out) gets a JSON 503 (bounded by ``FAREWELL_TIMEOUT``) before the
cancellation goes on.

:func:`lifespan` closes the registry when the app shuts down, inside the app's own
lifespan so the producer still runs while requests drain. But uvicorn runs the
lifespan shutdown only after every connection has closed, and a stream keeps its
connection open: the drain has to start when the server's shutdown starts. The
middleware does that: during the lifespan it chains the server's SIGINT and SIGTERM
handlers (:mod:`._shutdown` says what it relies on), so installing it is enough under
``uvicorn app:app``, ``fastapi run`` and gunicorn's uvicorn workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, TypeVar

from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether
from tether.http import (
    FAREWELL_TIMEOUT,
    REQUEST_ID_HEADER,
    accept_request_id,
    error_response,
    stop_tasks,
)

from ._shutdown import DrainOnSignal

__all__ = [
    "DRAIN_KEY",
    "READ_AHEAD",
    "REGISTRY_KEY",
    "SCOPE_KEY",
    "TetherMiddleware",
    "get_registry",
    "lifespan",
    "request_scope",
]

REGISTRY_KEY: Final = "tether.registry"
"""The ASGI scope key under which the middleware puts its registry for handlers."""

SCOPE_KEY: Final = "tether.scope"
"""The ASGI scope key under which the middleware puts the request's
:class:`tether.RequestScope`; its presence marks a request that already has one."""

DRAIN_KEY: Final = "tether.drain"
"""The lifespan scope key under which the middleware puts its
:class:`~tether_starlette._shutdown.DrainOnSignal`; its presence marks a lifespan
whose shutdown signals are already chained."""

READ_AHEAD: Final = 64 * 1024
"""Bytes of body the reader holds for an app that has not read them yet: reading
ahead is how a disconnect (reported only by ``receive``, after the body) is seen
while the app is busy elsewhere. Past it the reader waits for the app and the
server's flow control holds the rest back, so an app that never reads a larger body
learns that its client left only when it answers. uvicorn buffers as much itself."""

AppT = TypeVar("AppT")

logger = logging.getLogger("tether.starlette")

_NOT_INSTALLED: Final = (
    "tether needs TetherMiddleware, which notices client disconnects and closes each "
    "request's streams: add it with app.add_middleware(TetherMiddleware, registry=registry)"
)


def get_registry(request: HTTPConnection) -> tether.Registry:
    """The registry given to :class:`TetherMiddleware`, for a handler.

    :param request: the request (or any connection) being handled.
    :raises RuntimeError: the middleware is not installed.
    """
    registry = request.scope.get(REGISTRY_KEY)
    if not isinstance(registry, tether.Registry):
        raise RuntimeError(_NOT_INSTALLED)
    return registry


def request_scope(request: HTTPConnection) -> tether.RequestScope:
    """The :class:`tether.RequestScope` the middleware opened for ``request``.

    :raises RuntimeError: the middleware is not installed.
    """
    scope = request.scope.get(SCOPE_KEY)
    if not isinstance(scope, tether.RequestScope):
        raise RuntimeError(_NOT_INSTALLED)
    return scope


def _repeat(item: Message | Exception) -> Message:
    if isinstance(item, Exception):
        raise item
    return item


def _require_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "TetherMiddleware needs an asyncio event loop, and this app runs on another "
            "(trio?): tether's core is asyncio-only. Run the server on asyncio "
            "(uvicorn's default loop, or hypercorn -k asyncio)."
        ) from None


class TetherMiddleware:
    """Gives every HTTP request a :class:`tether.RequestScope` and client-disconnect
    detection; install it with ``Middleware(TetherMiddleware, registry=...)`` or
    ``app.add_middleware(TetherMiddleware, registry=...)``.

    Other scope types (lifespan, websocket) pass straight through. Installed twice,
    the inner one finds the outer one's mark in the request's ASGI scope
    (:data:`SCOPE_KEY`) and passes the request through: one scope, one reader.

    The lifespan passes through too, with one addition: from its start-up to its
    shutdown, the server's SIGINT and SIGTERM handlers are chained so that the
    server's shutdown starts ``registry.close(drain_timeout=...)`` at once (see
    :mod:`tether_starlette._shutdown` and ``docs/starlette.md``): under
    ``uvicorn app:app``, ``fastapi run``, gunicorn's uvicorn workers, open streams end
    with their error event within the drain timeout instead of holding the server.

    :param app: the ASGI app to wrap.
    :param registry: the app's registry; handlers find it with :func:`get_registry`.
    :param drain_timeout: seconds requests in flight get, once the server's shutdown
        signal arrived, before they are aborted; ``None`` leaves the server's signals
        alone (the registry is then closed by :func:`lifespan`, or by you).
    :raises RuntimeError: (when called) the server does not run on asyncio, or the
        middleware is installed twice with two registries.
    """

    __slots__ = ("_on_asyncio", "app", "drain_timeout", "registry")

    def __init__(
        self, app: ASGIApp, *, registry: tether.Registry, drain_timeout: float | None = 5.0
    ) -> None:
        self.app = app
        self.registry = registry
        self.drain_timeout = drain_timeout
        self._on_asyncio = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._on_asyncio:  # checked until it holds once: a server keeps its loop kind
            _require_asyncio()
            self._on_asyncio = True
        # Not the current scope: the task may have inherited a finished request's.
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
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
        scope[REGISTRY_KEY] = self.registry
        channel = _Channel(receive, send)
        channel.request_id = request_id = _request_id(scope)
        with tether.RequestScope(
            on_first_track=channel.watch, request_id=request_id
        ) as request_scope:
            scope[SCOPE_KEY] = channel.scope = request_scope
            try:
                await self._answer(scope, channel)
            except OSError as exc:
                if exc is not channel.send_error:
                    raise
                # ASGI 2.4: the client left while the app was answering; nothing to add.
            finally:
                await channel.stop()

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, with the server's shutdown signals chained to a drain
        from its start-up to its shutdown (once, if the middleware is installed twice)."""
        if self.drain_timeout is None or DRAIN_KEY in scope:
            await self.app(scope, receive, send)
            return
        hook = scope[DRAIN_KEY] = DrainOnSignal(self.registry, drain_timeout=self.drain_timeout)

        async def hooked_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                hook.install()
            elif message["type"] == "lifespan.shutdown":
                # Before the app's own shutdown: its producer still runs for the drain.
                await hook.aclose()
            return message

        try:
            await self.app(scope, hooked_receive, send)
        finally:
            await hook.aclose()

    async def _answer(self, scope: Scope, channel: _Channel) -> None:
        try:
            await self.app(scope, channel.receive, channel.send)
        except tether.TetherError as exc:
            if channel.started:
                raise
            error = error_response(exc)
            answer = JSONResponse(error.body, error.status, headers=error.headers)
            await answer(scope, channel.receive, channel.send)
        except asyncio.CancelledError:
            # The server cancelled the handler (a shutdown whose grace period ran out)
            # while it waited for its answer: the client is still there and is told.
            if not channel.started:
                await _farewell(scope, channel)
            raise


class _Channel:
    """One request's link to the server: the watcher of ``send``, which knows whether
    the response started and completed, and, once the request has work to abort,
    the only reader of ``receive``.

    Until the request's scope adopts its first stream, the app's ``receive`` goes
    straight to the server: a request with nothing to abort (a health check) costs
    no task. From then on an owned reader task reads ``receive``, keeping up to
    :data:`READ_AHEAD` bytes of body for the app (in order) and catching the
    ``http.disconnect`` the moment the server reports it.
    """

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
        self._receive = receive
        self._send = send
        self.scope: tether.RequestScope | None = None
        self.request_id: str | None = None  # echoed on the response
        self._reader: asyncio.Task[None] | None = None
        self._body: collections.deque[Message] = collections.deque()  # read, not yet taken
        self._buffered = 0  # bytes in _body
        # Made when first waited on (a GET whose app never waits for its body needs neither):
        self._arrived: asyncio.Event | None = None  # set by the reader: a message or the end
        self._room: asyncio.Event | None = None  # set by the app: it took a message
        self._last: Message | Exception | None = None
        self._in_receive = False  # the app is in a direct receive() now
        self._wanted = False
        self.started = False
        self.complete = False
        self.send_error: OSError | None = None

    def watch(self) -> None:
        """Start reading ``receive`` (the scope adopted its first stream)."""
        self._wanted = True
        if not self._in_receive:  # else the app's receive() starts it when it returns
            self._start()

    def _start(self) -> None:
        if self._reader is None and self._last is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read(), name="tether-receive"
            )

    def _arrive(self) -> None:
        """A message or the end is there: wake the app if it waits in ``receive()``."""
        arrived = self._arrived
        if arrived is not None:
            arrived.set()

    def _gone(self) -> None:
        if not self.complete and self.scope is not None:
            self.scope.disconnect()

    async def _read(self) -> None:
        """The reader task: read the body ahead of the app, then wait for the disconnect."""
        receive, body = self._receive, self._body
        while True:
            while self._buffered >= READ_AHEAD:  # the app is behind: let the server hold on
                room = self._room
                if room is None:
                    room = self._room = asyncio.Event()
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
                self._arrive()
            # else: the app answered without reading its whole body; drop the rest, as
            # Starlette's own responses do, so that the disconnect is still seen.
        self._gone()
        self._last = last
        self._arrive()

    async def stop(self) -> None:
        """End the reader, if it started (the request is over)."""
        reader = self._reader
        if reader is None:
            return
        await stop_tasks((reader,))

    async def receive(self) -> Message:
        """The app's ``receive``: body messages in order, then the disconnect, forever."""
        if self._reader is None:
            last = self._last
            if last is not None:
                return _repeat(last)
            self._in_receive = True
            try:
                message = await self._receive()
            finally:
                self._in_receive = False
            if message["type"] == "http.disconnect":
                self._last = message
                self._gone()
            elif self._wanted:
                self._start()
            return message
        body = self._body
        while not body:
            last = self._last
            if last is not None:
                return _repeat(last)
            arrived = self._arrived
            if arrived is None:
                arrived = self._arrived = asyncio.Event()
            arrived.clear()
            await arrived.wait()
        message = body.popleft()
        self._buffered -= len(message.get("body", b""))
        room = self._room
        if room is not None:
            room.set()
        return message

    async def send(self, message: Message) -> None:
        """The app's ``send``: tracks the response, and turns ``OSError`` into a disconnect."""
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
            # disconnect before this coroutine resumes.
            self.complete = True
        try:
            await self._send(message)
        except OSError as exc:
            self.send_error = exc
            if self.scope is not None:
                self.scope.disconnect()
            raise


_REQUEST_ID_NAME: Final = REQUEST_ID_HEADER.lower().encode("latin-1")


def _request_id(scope: Scope) -> str | None:
    """The client's ``X-Request-Id`` (the first one), if it is an acceptable label."""
    for name, value in scope.get("headers", ()):
        if name == _REQUEST_ID_NAME:
            return accept_request_id(value)
    return None


def _with_request_id(message: Message, request_id: str) -> Message:
    """The response start ``message`` with the request id echoed (replacing the app's)."""
    headers = [pair for pair in message.get("headers", ()) if pair[0].lower() != _REQUEST_ID_NAME]
    headers.append((_REQUEST_ID_NAME, request_id.encode("ascii")))
    return {**message, "headers": headers}


async def _farewell(scope: Scope, channel: _Channel) -> None:
    """A JSON 503 for a request whose handler the server cancelled before it answered:
    its work is aborted now, and the answer is best effort, bounded."""
    if channel.scope is not None:
        channel.scope.close()
    error = error_response(
        tether.Aborted("-", tether.AbortReason.SERVER, "the server ended the request")
    )
    answer = JSONResponse(error.body, error.status, headers=error.headers)
    try:
        async with asyncio.timeout(FAREWELL_TIMEOUT):
            await answer(scope, channel.receive, channel.send)
    except Exception as exc:  # best effort: the cancellation is what goes on
        logger.debug("the answer to a cancelled request was not sent: %r", exc)


def lifespan(
    registry: tether.Registry,
    *,
    drain_timeout: float = 5.0,
    inner: Callable[[AppT], AbstractAsyncContextManager[Any]] | None = None,
) -> Callable[[AppT], AbstractAsyncContextManager[Any]]:
    """A Starlette lifespan that closes ``registry`` at shutdown, around ``inner``'s.

    ``registry.close(drain_timeout=...)`` runs *inside* ``inner``'s context, so the
    producer ``inner`` starts is still running while requests in flight drain; what is
    left then ends with a final error event. Use ``Starlette(lifespan=lifespan(reg,
    inner=app_lifespan))``; the state ``inner`` yields is passed on.

    When the server stops on a signal, :class:`TetherMiddleware` has already drained
    the registry (with *its* ``drain_timeout``) by the time this runs: the lifespan's
    close is for servers stopped without a signal.

    :param registry: the registry to close.
    :param drain_timeout: seconds requests in flight get to finish before being aborted.
    :param inner: the app's own lifespan (starts and stops the producer), if any.
    """

    @contextlib.asynccontextmanager
    async def run(app: AppT) -> AsyncIterator[Any]:
        async with contextlib.AsyncExitStack() as stack:
            state = None if inner is None else await stack.enter_async_context(inner(app))
            try:
                yield state
            finally:
                await registry.close(drain_timeout=drain_timeout)

    return run
