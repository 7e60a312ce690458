"""FastAPI helpers: the registry as a dependency (:data:`RegistryDep`), tether's error
shape for FastAPI's own errors (:func:`add_exception_handlers`, opt-in), OpenAPI for
streaming endpoints (:func:`event_stream`), and FastAPI's SSE reading tether
(:func:`events`). Importing it imports FastAPI (``import tether_starlette`` does not)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeAlias

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.sse import ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response

import tether
from tether import http
from tether.http import ErrorResponse, Schema

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
    return http.validation_error(exc.errors())


def add_exception_handlers(app: FastAPI, *, shape: Shape | None = None) -> None:
    """Answer FastAPI's validation errors and HTTP errors in tether's error shape,
    replacing FastAPI's handlers; ``shape``, and the refusal of a second call, as in
    :func:`tether_starlette.json_errors`."""
    json_errors(app, shape=shape)
    handler = validation_exception_handler if shape is None else shaped(_validation_error, shape)
    app.add_exception_handler(RequestValidationError, handler)


def event_stream(
    item: Schema | None = None, *, json: Schema | None = None, status_code: int = 200
) -> dict[str, Any]:
    """Decorator arguments documenting a ``respond()`` endpoint as ``text/event-stream``
    of ``item`` (and ``json`` for one body): see :func:`tether.http.event_stream_responses`::

        @app.post("/generate", **event_stream(Token, json=Result))
        async def generate(...) -> Response:
            return await respond(request, stream, streaming=body.stream)

    ``response_class`` is a bare ``Response``, so that FastAPI adds no schema of its own.

    :raises TypeError: a model is recursive (pass its schema as a dict)."""
    responses = http.event_stream_responses(item, json=json, status_code=status_code)
    return {"response_class": Response, "responses": responses}


async def events(source: tether.Stream | tether.Batch, *, done: bool = True) -> AsyncIterator[Any]:
    """The outputs of ``source`` for a FastAPI ``EventSourceResponse`` generator
    (``async for output in events(stream): yield output``); ``respond()`` is faster.
    A batch's are ``{"index": i, "output": value}`` (a failed one, with ``keep_going``:
    ``{"index": i, "error": {...}}``). A client that left ends it quietly, another tether
    error is one error event; then ``[DONE]`` if ``done``. ``source`` is closed after.
    """
    async with source:
        try:
            if isinstance(source, tether.Batch):
                async for index, output in source:
                    if isinstance(output, BaseException):  # (keep_going: it stands in place)
                        yield {"index": index, **http.error_response(output).body}
                    else:
                        yield {"index": index, "output": output}
            else:
                async for output in source:
                    yield output
        except tether.TetherError as exc:
            if isinstance(exc, tether.Aborted) and exc.reason in http.NOBODY_READS:
                return  # nobody to tell
            yield ServerSentEvent(data=http.error_response(exc).body)
    if done:
        yield ServerSentEvent(raw_data="[DONE]")
