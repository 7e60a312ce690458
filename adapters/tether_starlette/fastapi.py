"""FastAPI helpers: the registry as a dependency, and tether's error shape for
FastAPI's own errors.

Importing this module imports FastAPI (``import tether_starlette`` does not)::

    from tether_starlette.fastapi import RegistryDep, add_exception_handlers

    add_exception_handlers(app)  # opt-in: 422s and 404s as {"error": {...}}

    @app.post("/generate")
    async def generate(body: Body, request: Request, registry: RegistryDep): ...

FastAPI answers a request that fails validation with ``{"detail": [...]}`` and
status 422, where tether's own errors are ``{"error": {"message", "type",
"code"}}``; clients that expect one shape (the OpenAI client reads ``error``) show
only "Error code: 422". :func:`add_exception_handlers` gives FastAPI's validation
errors and HTTP errors (404, 405...) tether's shape, keeping FastAPI's details
under ``error.detail``.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

from fastapi import Depends, FastAPI
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tether

from ._middleware import get_registry

__all__ = [
    "RegistryDep",
    "add_exception_handlers",
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
