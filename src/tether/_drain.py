"""Draining at the moment the server's shutdown begins, under any ASGI server.

uvicorn and hypercorn wait for every open connection to close before they run the
lifespan shutdown, and a stream keeps its connection open: a drain started from the
lifespan starts too late (the server waits for streams that wait for the drain).
The moment the shutdown begins is the server's signal handler. :class:`DrainOnSignal`
*chains* it: at lifespan start-up (``tether_starlette.TetherMiddleware`` installs it) it
puts its own handler in front of whatever Python handler the server installed for
SIGINT and SIGTERM; on a signal it calls the server's handler (which starts the
server's shutdown, exactly as before) and starts ``registry.close(drain_timeout=...)``
on the loop. New requests then get 503, requests in flight have ``drain_timeout``
seconds to finish, and the rest end with their error event and terminal frame, so
the server's wait for connections ends within the drain timeout.

What this relies on, and where it holds:

- The server installs its handlers with :func:`signal.signal` before the lifespan
  starts, in the main thread: uvicorn (``uvicorn app:app``, ``uvicorn.run``,
  ``fastapi run``, its ``--workers`` and ``--reload`` children, gunicorn's uvicorn
  workers: ``Server.capture_signals``). A server that uses
  ``loop.add_signal_handler`` (hypercorn with ``--workers 0``) leaves a Python-level
  no-op handler in place and learns of the signal through the loop's wake-up file
  descriptor, which a Python handler in front does not disturb: both run.
- Only a handler the server installed is chained: ``SIG_DFL``, ``SIG_IGN`` and
  Python's own ``default_int_handler`` are left alone (the server does not handle
  that signal, so there is no shutdown to drain for). hypercorn's worker processes
  ignore SIGINT and take their shutdown from the parent through a multiprocessing
  event, with no signal in the worker: there the drain is hypercorn's
  ``--graceful-timeout``, at whose end hypercorn cancels the requests still running
  and tether's cancellation path ends each one properly (an error event and the
  terminal frame, a JSON 503).
- Signals go to the main thread: a server run in another thread gets no hook.

The chain is undone at lifespan shutdown if the handler in place is still ours (a
handler installed later, in front of ours, is left alone and ours turns into a plain
pass-through); uvicorn restores its own saved handlers when it exits in any case.
A second signal during the drain (uvicorn's forced exit on a second Ctrl-C) ends the
drain at once: every request left is aborted and ends properly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from types import FrameType
from typing import Any, Final, TypeVar

from ._registry import Registry

__all__ = ["SIGNALS", "DrainOnSignal", "lifespan"]

AppT = TypeVar("AppT")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)
"""The signals that begin a server's graceful shutdown, whose handlers are chained."""

logger = logging.getLogger("tether")


def _chainable(handler: Any) -> bool:
    """Whether ``handler`` is a Python handler that a server installed (one to chain)."""
    return callable(handler) and handler is not signal.default_int_handler


class DrainOnSignal:
    """Starts ``registry.close(drain_timeout=...)`` when the server's shutdown signal
    arrives, after calling the server's own handler.

    Owned by an adapter's lifespan pass: :meth:`install` at start-up (on the
    loop, in the main thread), :meth:`aclose` at shutdown, which undoes the chain and
    awaits the drain it started, if any.

    :param registry: the registry to close.
    :param drain_timeout: seconds requests in flight get before they are aborted.
    """

    __slots__ = ("_active", "_cut", "_drain", "_loop", "_previous", "drain_timeout", "registry")

    def __init__(self, registry: Registry, *, drain_timeout: float) -> None:
        self.registry = registry
        self.drain_timeout = drain_timeout
        self._previous: dict[int, Any] = {}  # signal -> the handler we chained
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._cut: asyncio.Task[None] | None = None
        self._active = False

    @property
    def installed(self) -> bool:
        """Whether a server's handler is chained now."""
        return self._active

    def install(self) -> None:
        """Chain the server's SIGINT and SIGTERM handlers; a no-op outside the main
        thread, and for a signal the server does not handle."""
        if threading.current_thread() is not threading.main_thread():
            logger.debug("not in the main thread: no drain on the server's signals")
            return
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            previous = signal.getsignal(sig)
            if _chainable(previous):
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
                self._active = True

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        previous = self._previous.get(sig)
        loop = self._loop
        try:
            if self._active and loop is not None and not loop.is_closed():
                # A signal handler runs between two bytecodes of the loop's thread:
                # the drain is scheduled, never run here.
                loop.call_soon_threadsafe(self._on_signal)
        finally:
            if previous is not None:
                previous(sig, frame)

    def _on_signal(self) -> None:
        """The first signal starts the drain; another one (uvicorn's forced exit on a
        second Ctrl-C) ends it at once: what is left is aborted now."""
        loop = asyncio.get_running_loop()
        if self._drain is None:
            if self.registry.closed:
                return  # closed by someone else: their drain, not ours
            logger.info(
                "shutdown: draining %d request(s), for up to %ss",
                self.registry.in_flight,
                self.drain_timeout,
            )
            self._drain = loop.create_task(
                self.registry.close(drain_timeout=self.drain_timeout), name="tether-drain"
            )
        elif self._cut is None:
            logger.info("shutdown: a second signal, the drain ends now")
            self._cut = loop.create_task(self.registry.close(drain_timeout=0), name="tether-cut")

    async def aclose(self) -> None:
        """Undo the chain (where ours is still the handler in place) and await the
        drain, if a signal started one."""
        self._active = False  # left behind a later handler, ours only forwards
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        for task in (self._drain, self._cut):
            if task is not None:
                await task

    async def around(self, app: Any, scope: Any, receive: Receive, send: Any) -> None:
        """Run the ASGI ``app``'s lifespan with the chain in place from its start-up to
        its shutdown (:meth:`hooked`), undone however it ends."""
        try:
            await app(scope, self.hooked(receive), send)
        finally:
            await self.aclose()

    def hooked(self, receive: Receive) -> Receive:
        """An ASGI lifespan's ``receive`` that installs the chain at start-up and undoes
        it (awaiting the drain) at shutdown, before the app's own shutdown runs: its
        producer still runs for the drain."""

        async def hooked_receive() -> MutableMapping[str, Any]:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.install()
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message

        return hooked_receive


def lifespan(
    registry: Registry,
    *,
    drain_timeout: float = 5.0,
    inner: Callable[[AppT], AbstractAsyncContextManager[Any]] | None = None,
) -> Callable[[AppT], AbstractAsyncContextManager[Any]]:
    """A lifespan (Starlette's ``lifespan=`` shape) that closes ``registry`` at
    shutdown, *inside* ``inner``'s, so that the producer ``inner`` starts still runs
    while requests in flight drain; what is left then ends with a final error event.
    ``Starlette(lifespan=lifespan(reg, inner=app_lifespan))``; ``inner``'s state is
    passed on. A server stopped on a signal was already drained by the middleware
    (:class:`DrainOnSignal`): this close is for servers stopped without one.

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
