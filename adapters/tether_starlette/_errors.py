"""json_errors(): Starlette's own errors (404, 405, any ``HTTPException``) in tether's
JSON error shape, as ``tether_aiohttp.json_errors`` (:func:`tether.http.http_error`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.http import ErrorResponse, http_error

__all__ = ["answer", "http_exception_handler", "json_errors", "shaped"]

Shape = Callable[[Request, ErrorResponse], ErrorResponse]
Handler = Callable[[Request, Exception], Any]
_INSTALLED: Final = "tether_json_errors"  # marks app.state: a second call is refused


def _http_error(request: Request, exc: Exception) -> ErrorResponse:
    if not isinstance(exc, HTTPException):
        raise exc
    return http_error(exc.status_code, exc.detail, exc.headers or {})  # (FastAPI's: any JSON)


def answer(error: ErrorResponse) -> Response:
    try:
        return JSONResponse(error.body, error.status, headers=error.headers)
    except (TypeError, ValueError):  # a detail that is not JSON: the message is enough
        body = {"error": {k: v for k, v in error.body["error"].items() if k != "detail"}}
        return JSONResponse(body, error.status, headers=error.headers)


def shaped(convert: Callable[[Request, Exception], ErrorResponse], shape: Shape) -> Handler:
    async def handler(request: Request, exc: Exception) -> Response:
        return answer(shape(request, convert(request, exc)))

    return handler


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """An ``HTTPException`` as tether's JSON error, with its headers (``Allow`` on a 405)."""
    return answer(_http_error(request, exc))


def json_errors(app: Starlette, *, shape: Shape | None = None) -> None:
    """Answer Starlette's HTTP errors with tether's JSON error (:func:`http_exception_handler`).

    :param shape: rewrites each error before it is sent, given the request (another
        error shape on some routes, say); the default sends tether's.
    :raises RuntimeError: ``json_errors()`` was already called on this app."""
    if getattr(app.state, _INSTALLED, False):
        raise RuntimeError("tether_starlette.json_errors() was already called on this app")
    handler = http_exception_handler if shape is None else shaped(_http_error, shape)
    app.add_exception_handler(HTTPException, handler)
    setattr(app.state, _INSTALLED, True)
