"""What adapter authors need: the HTTP exchange, the error mapping, the request scope.

``import tether`` is for application authors (the registry, streams, errors,
encoders). An adapter for a web framework (tether ships ``tether_starlette`` and
``tether_aiohttp``; write one for another framework with these names alone) opens
a :class:`~tether.RequestScope` per request, tells it when the client leaves, and
moves the bytes an :class:`Exchange` gives::

    exchange = Exchange(source, streaming=True)
    try:
        head = await exchange.start()        # status, headers, first bytes
        write_head(head)                     # whole, if exchange.done
        while not exchange.done:
            chunk = exchange.ready_chunk()   # no coroutine when something is ready
            if chunk is None:
                chunk = await exchange.wait_chunk()
            exchange.writing()               # the send timeout, as bookkeeping
            await write(chunk)
            exchange.written()
    except asyncio.CancelledError:
        if exchange.stalled():               # the send timeout: the client stopped reading
            return
        write(exchange.farewell())           # the server cancelled the handler
        raise                                # (or exchange.farewell_head(), not started)
    finally:
        await exchange.aclose()

Failures before the status line go through :func:`error_response` (the one mapping
from an exception to a status, a JSON body and headers). A client's
:data:`REQUEST_ID_HEADER` goes through :func:`accept_request_id` into the scope
(``RequestScope(request_id=...)``) and back on the response.
"""

from __future__ import annotations

from ._channel import Channel, Follower, Keeper
from ._exchange import FAREWELL_TIMEOUT, Exchange
from ._replay import new_token
from ._responses import (
    CLIENT_CLOSED_REQUEST,
    DEFAULT_SEND_TIMEOUT,
    ErrorResponse,
    Head,
    error_body,
    error_response,
)
from ._resume import (
    NOT_RESUMABLE,
    RESUME_UNAVAILABLE,
    TOKEN_HEADER,
    ResumePoint,
    resume_point,
)
from ._scope import MAX_REQUEST_ID_LENGTH, REQUEST_ID_HEADER, accept_request_id, current_scope
from ._tasks import stop_tasks

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "FAREWELL_TIMEOUT",
    "MAX_REQUEST_ID_LENGTH",
    "NOT_RESUMABLE",
    "REQUEST_ID_HEADER",
    "RESUME_UNAVAILABLE",
    "TOKEN_HEADER",
    "Channel",
    "ErrorResponse",
    "Exchange",
    "Follower",
    "Head",
    "Keeper",
    "ResumePoint",
    "accept_request_id",
    "current_scope",
    "error_body",
    "error_response",
    "new_token",
    "resume_point",
    "stop_tasks",
]
