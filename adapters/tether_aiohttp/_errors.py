"""json_errors(): aiohttp's own errors in tether's JSON error shape, as on Starlette.

aiohttp answers an unknown route (404), a wrong method (405), a body past
``client_max_size`` (413) and any ``web.HTTPException`` a handler raises with a
text body, where tether's errors are JSON. ``tether_starlette.json_errors`` makes the
same offer to Starlette and FastAPI apps, with the same bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from tether.http import ErrorResponse

__all__ = ["json_errors"]

Shape = Callable[[web.Request, ErrorResponse], ErrorResponse]
_INSTALLED: Final = web.AppKey("tether_json_errors", bool)
_OWN_HEADERS: Final = frozenset({"content-type", "content-length"})


def json_errors(app: web.Application, *, shape: Shape | None = None) -> None:
    """Answer aiohttp's HTTP errors (status 400 and above) with tether's JSON error body,
    ``{"error": {"message": <reason>, "type": "HTTPException", "code": <status>}}``,
    keeping their headers (``Allow`` on a 405).

    :param shape: rewrites each error before it is sent, given the request (another
        error shape on some routes, say); the default sends tether's.
    :raises RuntimeError: ``json_errors()`` was already called on this app.
    """
    if app.get(_INSTALLED):
        raise RuntimeError("tether_aiohttp.json_errors() was already called on this app")

    @web.middleware
    async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise  # redirects and successes raised as exceptions stay what they are
            headers = {k: v for k, v in exc.headers.items() if k.lower() not in _OWN_HEADERS}
            body = {"error": {"message": exc.reason, "type": "HTTPException", "code": exc.status}}
            error = ErrorResponse(exc.status, body, headers)
            if shape is not None:
                error = shape(request, error)
            return web.json_response(error.body, status=error.status, headers=error.headers)

    app[_INSTALLED] = True
    app.middlewares.append(errors_as_json)
