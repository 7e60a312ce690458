"""FastAPI helpers: the registry as a dependency, tether's error shape for FastAPI's
own errors (:func:`add_exception_handlers`), OpenAPI for streaming endpoints
(:func:`event_stream`), and FastAPI's SSE reading tether (:func:`events`).
Importing this module imports FastAPI (``import tether_starlette`` does not)::

    add_exception_handlers(app)  # opt-in: 422s and 404s as {"error": {...}}

    @app.post("/generate", **event_stream(Token))  # documented as text/event-stream
    async def generate(body: Body, request: Request, registry: RegistryDep): ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeAlias

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.sse import ServerSentEvent
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

import tether
from tether.http import (
    NOBODY_READS,
    ErrorResponse,
    error_response,
    event_stream_responses,
    validation_error,
)

from ._errors import Shape, answer, http_exception_handler, json_errors, shaped
from ._middleware import get_registry

__all__ = [
    "RegistryDep",
    "add_exception_handlers",
    "event_stream",
    "events",
    "http_exception_handler",
    "validation_exception_handler",
]

RegistryDep: TypeAlias = Annotated[tether.Registry, Depends(get_registry)]
"""A handler parameter typed ``RegistryDep`` receives the middleware's registry."""


async def validation_exception_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's request validation error in tether's error shape: see
    :func:`tether.http.validation_error` (a 422, or a 400 for a body that is not JSON)."""
    return answer(_validation_error(request, exc))


def _validation_error(request: Request, exc: Exception) -> ErrorResponse:
    if not isinstance(exc, RequestValidationError):
        raise exc
    return validation_error(exc.errors())


def add_exception_handlers(app: FastAPI, *, shape: Shape | None = None) -> None:
    """Answer FastAPI's validation errors and HTTP errors in tether's error shape,
    replacing FastAPI's handlers (HTTP errors through :func:`tether_starlette.json_errors`).

    :param shape: rewrites each error before it is sent, given the request (another
        error shape on some routes, say); the default sends tether's.
    """
    json_errors(app, shape=shape)
    handler = validation_exception_handler if shape is None else shaped(_validation_error, shape)
    app.add_exception_handler(RequestValidationError, handler)


def event_stream(
    item: type[BaseModel] | dict[str, Any] | None = None,
    *,
    json: type[BaseModel] | dict[str, Any] | None = None,
    status_code: int = 200,
) -> dict[str, Any]:
    """Decorator arguments that document an endpoint answering with ``respond()`` as
    ``text/event-stream`` of ``item`` (and ``application/json`` of ``json``, if it may
    answer one body): see :func:`tether.http.event_stream_responses`::

        @app.post("/generate", **event_stream(Token, json=Result))
        async def generate(...) -> Response:
            return await respond(request, stream, streaming=body.stream)

    ``response_class`` is a bare ``Response``, so that FastAPI adds no schema of its own.

    :raises TypeError: a model is recursive (pass its schema as a dict).
    """
    responses = event_stream_responses(item, json=json, status_code=status_code)
    return {"response_class": Response, "responses": responses}


async def events(source: tether.Stream | tether.Batch, *, done: bool = True) -> AsyncIterator[Any]:
    """The outputs of ``source``, for a FastAPI ``EventSourceResponse`` generator::

        @app.post("/generate", response_class=EventSourceResponse)
        async def generate(...) -> AsyncIterator[Any]:
            stream = registry.open()
            engine.submit(stream.rid, ...)
            async for output in events(stream):
                yield output

    A batch's outputs come as they arrive, each as ``{"index": i, "output": value}``
    (a field of the output can never stand for its index); with ``keep_going``, a
    failed sub-request as ``{"index": i, "error": {...}}``. A client that left ends
    the iteration quietly (its work is already aborted); any other tether error (a
    timeout, a producer error, the server's shutdown) becomes one error event in
    tether's shape; then, with ``done``, the terminal ``[DONE]`` event. The source is
    closed when the iteration ends, however it ends.

    :param source: the request's stream or batch; iterating it here is reading it.
    :param done: end with a ``data: [DONE]`` event, as ``respond()`` does.
    """
    async with source:
        try:
            if isinstance(source, tether.Batch):
                async for index, output in source:
                    if isinstance(output, BaseException):  # (keep_going: it stands in place)
                        yield {"index": index, **error_response(output).body}
                    else:
                        yield {"index": index, "output": output}
            else:
                async for output in source:
                    yield output
        except tether.TetherError as exc:
            if isinstance(exc, tether.Aborted) and exc.reason in NOBODY_READS:
                return  # nobody to tell
            yield ServerSentEvent(data=error_response(exc).body)
    if done:
        yield ServerSentEvent(raw_data="[DONE]")
