"""setup(): the aiohttp plugin (aio-libs' convention: ``Final`` :class:`~aiohttp.web.AppKey`,
``cleanup_ctx``) that gives every request a :class:`tether.RequestScope` and drains on
shutdown. With ``handler_cancellation=False`` (``run_app``'s default) aiohttp tells no
one that a client left, only its transport closes: one watcher task per app checks
the transports of the requests in flight every ``poll_interval`` (and sleeps while
there are none). With ``handler_cancellation=True`` the cancelled handler is the sign."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

import tether
from tether import http

__all__ = ["REGISTRY_KEY", "SCOPE_KEY", "get_registry", "request_scope", "setup"]

REGISTRY_KEY: Final = web.AppKey("registry", tether.Registry)
"""Where :func:`setup` stores the registry on the application."""

SCOPE_KEY: Final = web.RequestKey("scope", tether.RequestScope)
"""Where the middleware keeps the request's :class:`tether.RequestScope`."""

# The registry of the installation that serves the request (the outermost one); set
# once the request's response is being prepared (its head goes out):
_SERVED_BY: Final = web.RequestKey("tether_registry", tether.Registry)
_STARTED: Final = web.RequestKey("tether_started", bool)

logger = logging.getLogger("tether.aiohttp")

_NOT_SET_UP: Final = "tether is not set up for this app: call tether_aiohttp.setup(app, ...) first"


def get_registry(app_or_request: web.Application | web.Request) -> tether.Registry:
    """The registry given to :func:`setup`, from the application or a request (in a
    sub-application's handler too); :class:`RuntimeError` if it was not called."""
    registry = (
        app_or_request.config_dict if isinstance(app_or_request, web.Request) else app_or_request
    ).get(REGISTRY_KEY)
    if registry is None:
        raise RuntimeError(_NOT_SET_UP)
    return registry


def request_scope(request: web.BaseRequest) -> tether.RequestScope:
    """The :class:`tether.RequestScope` the middleware opened for ``request``.

    :raises RuntimeError: the request did not go through the middleware of :func:`setup`.
    """
    try:
        return request[SCOPE_KEY]
    except KeyError:
        raise RuntimeError(_NOT_SET_UP) from None


def answer_scope(request: web.BaseRequest) -> tether.RequestScope:
    """:func:`request_scope`, for ``respond()``: refused once the response started."""
    if request.get(_STARTED):
        raise RuntimeError("this request's response has started: a request gets one response")
    return request_scope(request)


class _Watcher:
    """Finds the requests whose client left, for servers that do not cancel handlers."""

    __slots__ = ("_active", "_interval", "_wakeup")

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._active: dict[tether.RequestScope, asyncio.BaseTransport] = {}
        self._wakeup: asyncio.Event | None = None  # made by run(), on the app's loop

    def watch(self, scope: tether.RequestScope, transport: asyncio.BaseTransport | None) -> None:
        if transport is None or transport.is_closing():
            scope.disconnect()
            return
        if not self._active and self._wakeup is not None:
            self._wakeup.set()
        self._active[scope] = transport

    def forget(self, scope: tether.RequestScope) -> None:
        self._active.pop(scope, None)

    async def run(self, app: web.Application) -> AsyncIterator[None]:
        """The ``cleanup_ctx`` owning the watcher task: started with the app, ended on cleanup."""
        self._wakeup = wakeup = asyncio.Event()
        task = asyncio.create_task(self._watch(wakeup), name="tether-aiohttp-disconnect-watcher")
        try:
            yield
        finally:
            self._wakeup = None
            task.cancel()
            await asyncio.wait([task])

    async def _watch(self, wakeup: asyncio.Event) -> None:
        active, interval = self._active, self._interval
        while True:
            if not active:
                wakeup.clear()
                await wakeup.wait()
            await asyncio.sleep(interval)
            self._sweep()

    def _sweep(self) -> None:
        # A function of its own: its locals (the scopes found) die when it returns,
        # instead of staying alive in the watcher's frame until the next check.
        active = self._active
        gone = [scope for scope, transport in active.items() if transport.is_closing()]
        for scope in gone:
            del active[scope]
            scope.disconnect()


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Echo the client's accepted ``X-Request-Id`` (the response is about to start)."""
    request[_STARTED] = True
    scope = request.get(SCOPE_KEY)
    if scope is not None and scope.request_id is not None:
        response.headers[http.REQUEST_ID_HEADER] = scope.request_id


def _whole(head: http.Head) -> web.Response:
    return web.Response(status=head.status, body=head.body, headers=head.headers)


async def _farewell(request: web.Request) -> None:
    """A JSON 503 for a request whose handler the server cancelled before it answered,
    best effort, bounded."""
    try:
        async with asyncio.timeout(http.FAREWELL_TIMEOUT):
            response = _whole(http.server_ended())
            await response.prepare(request)
            await response.write_eof()
    except Exception as exc:  # best effort: the cancellation is what goes on
        logger.debug("the answer to a cancelled request was not sent: %r", exc)


def setup(
    app: web.Application,
    registry: tether.Registry,
    *,
    drain_timeout: float = 5.0,
    poll_interval: float = 0.02,
) -> None:
    """Install tether on an aiohttp application: the registry under :data:`REGISTRY_KEY`,
    the middleware that opens a :class:`tether.RequestScope` per request (turning a
    client that left into ``disconnect()``, a :class:`tether.TetherError` from a handler
    before its response started into its status and JSON body), and the shutdown drain.
    A sub-app of an app that has it passes the request through (another registry: refused).

    :param app: the application; sub-applications see it through ``request.config_dict``.
    :param registry: the registry the handlers open streams on.
    :param drain_timeout: seconds requests in flight at shutdown may take to finish.
    :param poll_interval: seconds between two checks for clients that left.
    :raises RuntimeError: ``setup`` was already called on this application.
    :raises ValueError: a negative ``drain_timeout`` or a non-positive ``poll_interval``.
    """
    if REGISTRY_KEY in app:
        raise RuntimeError(
            "tether_aiohttp.setup() was already called on this app; call it once per app"
        )
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be at least 0, got {drain_timeout}")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be positive, got {poll_interval}")
    watcher = _Watcher(poll_interval)

    @web.middleware
    async def tether_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        # (a Request's `in` and get() raise a KeyError for a key it lacks: asked only
        # of a request that holds something, and _STARTED is held from here on)
        if request and SCOPE_KEY in request:  # installed on a parent app too: it serves
            if request[_SERVED_BY] is not registry:
                raise RuntimeError(
                    "tether_aiohttp.setup() was called on an app and its sub-app with two "
                    "registries; call it once, on the outermost app"
                )
            return await handler(request)
        transport = request.transport
        scope = tether.RequestScope(  # (no transport: the watcher disconnects it at once)
            client_gone=None if transport is None else transport.is_closing,
            request_id=http.accept_request_id(request.headers.get(http.REQUEST_ID_HEADER)),
        )
        request[SCOPE_KEY], request[_SERVED_BY], request[_STARTED] = scope, registry, False
        watcher.watch(scope, transport)
        with scope:
            try:
                return await handler(request)
            except tether.TetherError as exc:
                if request.get(_STARTED):  # (a second response would land in the body)
                    raise
                return _whole(http.error_head(exc))
            except asyncio.CancelledError:
                # handler_cancellation=True: aiohttp cancels the handler when the client
                # leaves; else the server ended it (shutdown): a client still there is told.
                if transport is None or transport.is_closing():
                    scope.disconnect()
                elif not request.get(_STARTED):
                    scope.close()
                    await _farewell(request)
                raise
            finally:
                watcher.forget(scope)

    async def drain(app: web.Application) -> None:
        await registry.close(drain_timeout=drain_timeout)

    app[REGISTRY_KEY] = registry
    app.on_response_prepare.append(_echo_request_id)
    app.middlewares.append(tether_middleware)
    app.cleanup_ctx.append(watcher.run)
    app.on_shutdown.append(drain)
