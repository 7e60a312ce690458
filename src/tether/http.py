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
            if not await exchange.bounded(write(await exchange.next_chunk())):
                break                        # the client stopped reading
    except asyncio.CancelledError:           # the server cancelled the handler
        write(exchange.farewell())           # (or exchange.farewell_head())
        raise
    finally:
        await exchange.aclose()

Failures before the status line go through :func:`error_response` (the one mapping
from an exception to a status, a JSON body and headers).
"""

from __future__ import annotations

from ._channel import Channel, Follower, Keeper
from ._exchange import FAREWELL_TIMEOUT, Exchange, Head
from ._replay import new_token
from ._responses import (
    CLIENT_CLOSED_REQUEST,
    DEFAULT_SEND_TIMEOUT,
    ErrorResponse,
    error_body,
    error_response,
)
from ._resume import NOT_RESUMABLE, TOKEN_HEADER, ResumePoint, resume_point
from ._scope import current_scope

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "FAREWELL_TIMEOUT",
    "NOT_RESUMABLE",
    "TOKEN_HEADER",
    "Channel",
    "ErrorResponse",
    "Exchange",
    "Follower",
    "Head",
    "Keeper",
    "ResumePoint",
    "current_scope",
    "error_body",
    "error_response",
    "new_token",
    "resume_point",
]
