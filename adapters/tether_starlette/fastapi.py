"""FastAPI helpers: the registry as a dependency, and tether's error shape for
FastAPI's own errors.

Importing this module imports FastAPI (``import tether_starlette`` does not)::

    from tether_starlette.fastapi import RegistryDep, add_exception_handlers

    add_exception_handlers(app)  # opt-in: 422s and 404s as {"error": {...}}

    @app.post("/generate")
    async def generate(body: Body, request: Request, registry: RegistryDep): ...

FastAPI's own server-sent events (a path operation with
``response_class=EventSourceResponse``, whose function yields) can read a tether stream
through :func:`events`, which ends quietly when the client left (a bare ``async for``
lets :class:`tether.Aborted` escape, and uvicorn logs "Exception in ASGI
application") and ends a failed request as ``respond()`` does: one error event and
``[DONE]``. ``respond(request, stream, streaming=True)`` remains the faster path (it
writes every ready output in one send).

FastAPI answers a request that fails validation with ``{"detail": [...]}`` and
status 422, where tether's own errors are ``{"error": {"message", "type",
"code"}}``; clients that expect one shape (the OpenAI client reads ``error``) show
only "Error code: 422". :func:`add_exception_handlers` gives FastAPI's validation
errors and HTTP errors (404, 405...) tether's shape, keeping FastAPI's details
under ``error.detail``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeAlias

from fastapi import Depends, FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.sse import ServerSentEvent
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tether
from tether.http import NOBODY_READS, error_response

from ._middleware import get_registry

__all__ = [
    "RegistryDep",
    "add_exception_handlers",
    "events",
    "http_exception_handler",
    "validation_exception_handler",
]

RegistryDep: TypeAlias = Annotated[tether.Registry, Depends(get_registry)]
"""A handler parameter typed ``RegistryDep`` receives the middleware's registry
(:func:`tether_starlette.get_registry` as a FastAPI dependency)."""


def _envelope(status: int, message: str, kind: str, detail: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind, "code": status}
    if detail is not None:
        error["detail"] = detail
    return {"error": error}


def _where(error: dict[str, Any]) -> str:
    return ".".join(str(part) for part in error.get("loc", ()))


async def validation_exception_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's request validation error as a 422 in tether's error shape; the first
    problem is the message, every problem is under ``error.detail``."""
    if not isinstance(exc, RequestValidationError):
        raise exc
    errors = list(exc.errors())
    if errors:
        first = errors[0]
        message = f"{_where(first)}: {first.get('msg', 'invalid')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
    else:
        message = "the request is invalid"
    body = _envelope(422, message, "RequestValidationError", jsonable_encoder(errors))
    return JSONResponse(body, 422)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """An ``HTTPException`` (FastAPI's or Starlette's: 404, 405, or raised by a
    handler) in tether's error shape, with its headers."""
    if not isinstance(exc, HTTPException):
        raise exc
    detail = exc.detail
    message = detail if isinstance(detail, str) else "HTTP error"
    body = _envelope(
        exc.status_code,
        message,
        "HTTPException",
        None if isinstance(detail, str) else jsonable_encoder(detail),
    )
    return JSONResponse(body, exc.status_code, headers=dict(exc.headers or {}))


def add_exception_handlers(app: FastAPI) -> None:
    """Answer FastAPI's validation errors and HTTP errors in tether's error shape.

    Opt-in: it replaces FastAPI's default handlers for
    :class:`~fastapi.exceptions.RequestValidationError` and
    :class:`~starlette.exceptions.HTTPException` on ``app``.
    """
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(HTTPException, http_exception_handler)


async def events(stream: tether.Stream, *, done: bool = True) -> AsyncIterator[Any]:
    """The outputs of ``stream``, for a FastAPI ``EventSourceResponse`` generator::

        @app.post("/generate", response_class=EventSourceResponse)
        async def generate(...) -> AsyncIterator[Any]:
            stream = registry.open()
            engine.submit(stream.rid, ...)
            async for output in events(stream):
                yield output

    A client that left ends the iteration quietly (its work is already aborted);
    any other tether error (a timeout, a producer error, the server's shutdown)
    becomes one error event in tether's shape; then, with ``done``, the terminal
    ``[DONE]`` event. The stream is closed when the iteration ends, however it ends.

    :param stream: the request's stream; iterating it here is reading it.
    :param done: end with a ``data: [DONE]`` event, as ``respond()`` does.
    """
    async with stream:
        try:
            async for output in stream:
                yield output
        except tether.TetherError as exc:
            if isinstance(exc, tether.Aborted) and exc.reason in NOBODY_READS:
                return  # nobody to tell
            yield ServerSentEvent(data=error_response(exc).body)
    if done:
        yield ServerSentEvent(raw_data="[DONE]")
