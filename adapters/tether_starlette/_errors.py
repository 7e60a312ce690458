"""json_errors(): Starlette's own errors in tether's JSON error shape, as on aiohttp.

Starlette (and FastAPI, whose ``HTTPException`` is Starlette's) answers an unknown
route (404), a wrong method (405) and any ``HTTPException`` a handler raises (a 413
for a body too large, say) with a text or ``{"detail"}`` body, where tether's errors
are ``{"error": {...}}``. ``tether_aiohttp.json_errors`` makes the same offer to
aiohttp apps, with the same bodies.
"""

from __future__ import annotations

import http
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tether.http import ErrorResponse

__all__ = ["http_exception_handler", "json_errors"]

Shape = Callable[[Request, ErrorResponse], ErrorResponse]


def _http_error(exc: HTTPException) -> ErrorResponse:
    status, detail = exc.status_code, exc.detail
    shown: Any = detail  # (typed str by Starlette; FastAPI's may be any JSON value)
    error: dict[str, Any] = {"message": shown, "type": "HTTPException", "code": status}
    if not isinstance(shown, str):
        error["message"] = http.HTTPStatus(status).phrase
        error["detail"] = shown
    return ErrorResponse(status, {"error": error}, dict(exc.headers or {}))


def _answer(error: ErrorResponse) -> Response:
    try:
        return JSONResponse(error.body, error.status, headers=error.headers)
    except (TypeError, ValueError):  # a detail that is not JSON: the message is enough
        body = {"error": {k: v for k, v in error.body["error"].items() if k != "detail"}}
        return JSONResponse(body, error.status, headers=error.headers)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """An ``HTTPException`` (404, 405, or raised by a handler) as tether's JSON error
    body, ``{"error": {"message": <detail>, "type": "HTTPException", "code": <status>}}``,
    with its headers (``Allow`` on a 405)."""
    if not isinstance(exc, HTTPException):
        raise exc
    return _answer(_http_error(exc))


def json_errors(app: Starlette, *, shape: Shape | None = None) -> None:
    """Answer Starlette's HTTP errors with tether's JSON error body (see
    :func:`http_exception_handler`); calling it again replaces the handler.

    :param shape: rewrites each error before it is sent, given the request (another
        error shape on some routes, say); the default sends tether's.
    """
    if shape is None:
        app.add_exception_handler(HTTPException, http_exception_handler)
        return

    async def shaped(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, HTTPException):
            raise exc
        return _answer(shape(request, _http_error(exc)))

    app.add_exception_handler(HTTPException, shaped)
