"""What adapter authors need: one HTTP exchange and its one write loop.

``import tether`` is for application authors (the registry, streams, errors,
encoders). An adapter for a web framework (tether ships ``tether_starlette`` and
``tether_aiohttp``; write one for another framework with these names alone) opens
a :class:`~tether.RequestScope` per request, tells it when the client leaves, and
hands a :class:`Responder` the few pieces of its framework (a :class:`Framework`):
the responder's ``respond`` and ``resume`` are the adapter's verbs. The response
itself is :meth:`Exchange.run` writing through a :class:`Writer`::

    exchange = Exchange(source, streaming=True, scope=scope)
    head = await exchange.start()            # status, headers, first bytes
    if exchange.done:
        send_whole(head)                     # a sized answer, ended
    else:
        await exchange.run(writer, head.body)   # every write, pings, the end

Failures before the status line go through :func:`error_head` (built on
:func:`error_response`, the one mapping from an exception to a status, a JSON body
and headers); a handler the server cancelled before it answered gets
:func:`server_ended`. A client's :data:`REQUEST_ID_HEADER` goes through
:func:`accept_request_id` into the scope and back on the response.
:class:`DrainOnSignal` starts the registry's drain on the server's shutdown signal.
A framework's own errors take tether's shape through :func:`http_error` and
:func:`validation_error`; :func:`event_stream_responses` documents a streaming
endpoint in OpenAPI.
"""

from __future__ import annotations

from ._drain import DrainOnSignal, lifespan
from ._errors import NOBODY_READS
from ._exchange import (
    FAREWELL_TIMEOUT,
    Direct,
    Exchange,
    Numbered,
    Writer,
    error_head,
    server_ended,
)
from ._responder import Framework, Responder, Resumable
from ._responses import (
    CLIENT_CLOSED_REQUEST,
    DEFAULT_SEND_TIMEOUT,
    ErrorResponse,
    Head,
    error_body,
    error_response,
)
from ._scope import MAX_REQUEST_ID_LENGTH, REQUEST_ID_HEADER, accept_request_id, current_scope
from ._shapes import Schema, event_stream_responses, http_error, validation_error
from ._stepped import Stepped
from ._tasks import Driven, read_ahead, stop_tasks

__all__ = [
    "CLIENT_CLOSED_REQUEST",
    "DEFAULT_SEND_TIMEOUT",
    "FAREWELL_TIMEOUT",
    "MAX_REQUEST_ID_LENGTH",
    "NOBODY_READS",
    "REQUEST_ID_HEADER",
    "Direct",
    "DrainOnSignal",
    "Driven",
    "ErrorResponse",
    "Exchange",
    "Framework",
    "Head",
    "Numbered",
    "Responder",
    "Resumable",
    "Schema",
    "Stepped",
    "Writer",
    "accept_request_id",
    "current_scope",
    "error_body",
    "error_head",
    "error_response",
    "event_stream_responses",
    "http_error",
    "lifespan",
    "read_ahead",
    "server_ended",
    "stop_tasks",
    "validation_error",
]
