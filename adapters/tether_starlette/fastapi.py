"""FastAPI helpers: the registry as a dependency, tether's error shape for FastAPI's
own errors, OpenAPI for streaming endpoints, and FastAPI's SSE reading tether.

Importing this module imports FastAPI (``import tether_starlette`` does not)::

    from tether_starlette.fastapi import RegistryDep, add_exception_handlers, event_stream

    add_exception_handlers(app)  # opt-in: 422s and 404s as {"error": {...}}

    @app.post("/generate", **event_stream(Token))  # documented as text/event-stream
    async def generate(body: Body, request: Request, registry: RegistryDep): ...

FastAPI documents a path operation that returns ``respond()``'s response as
``application/json`` with an empty schema; :func:`event_stream` gives the decorator
what documents it as FastAPI documents its own ``EventSourceResponse``: a
``text/event-stream`` whose events carry the item schema (and, for an endpoint that
answers JSON too, that body's schema).

FastAPI's own server-sent events (a path operation with
``response_class=EventSourceResponse``, whose function yields) can read a tether
stream or batch through :func:`events`, which ends quietly when the client left (a
bare ``async for`` lets :class:`tether.Aborted` escape, and uvicorn logs "Exception
in ASGI application") and ends a failed request as ``respond()`` does: one error
event and ``[DONE]``. ``respond(request, stream, streaming=True)`` remains the faster
path (it writes every ready output in one send).

FastAPI answers a request that fails validation with ``{"detail": [...]}`` and
status 422, where tether's own errors are ``{"error": {"message", "type",
"code"}}``; clients that expect one shape (the OpenAI client reads ``error``) show
only "Error code: 422". :func:`add_exception_handlers` gives FastAPI's validation
errors and HTTP errors (404, 405...) tether's shape, keeping FastAPI's details
under ``error.detail`` without the input they were about: a body that is not JSON is
a 400, and what a client sent (``NaN``, a lone surrogate, a megabyte) is never
echoed, so that the error itself can always be written.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Final, TypeAlias

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.sse import ServerSentEvent
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import tether
from tether.http import NOBODY_READS, ErrorResponse, error_response

from ._errors import http_exception_handler, json_errors
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
"""A handler parameter typed ``RegistryDep`` receives the middleware's registry
(:func:`tether_starlette.get_registry` as a FastAPI dependency)."""

Shape = Callable[[Request, ErrorResponse], ErrorResponse]

_NOT_TEXT: Final = re.compile(r"[\ud800-\udfff]")
_MAX_SHOWN: Final = 80
"""Characters of a client's own key (in an error's ``loc``) shown back to it."""


def _shown(part: Any) -> str | int:
    # A loc names the place with the client's own keys: printable, short, encodable.
    if isinstance(part, int) and not isinstance(part, bool):
        return part
    text = _NOT_TEXT.sub("\ufffd", str(part))
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _problems(exc: RequestValidationError) -> list[dict[str, Any]]:
    """Each problem as ``{"type", "loc", "msg"}``: never its ``input`` (which may be
    ``NaN``, a lone surrogate or the whole body) nor its ``ctx``."""
    return [
        {
            "type": str(error.get("type", "")),
            "loc": [_shown(part) for part in error.get("loc", ())],
            "msg": str(_shown(error.get("msg", "invalid"))),
        }
        for error in exc.errors()
    ]


def _validation_error(exc: RequestValidationError) -> ErrorResponse:
    errors = list(exc.errors())
    if any(error.get("type") == "json_invalid" for error in errors):
        # FastAPI's loc is ("body", <character offset>): not a place a client can fix.
        reason = next(iter(errors)).get("ctx", {}).get("error", "")
        message = "the request body is not valid JSON"
        if isinstance(reason, str) and reason:
            message += f": {_shown(reason)}"
        detail = [{"type": "json_invalid", "loc": ["body"], "msg": message}]
        body = {"error": {"message": message, "type": "RequestValidationError", "code": 400}}
        body["error"]["detail"] = detail
        return ErrorResponse(400, body, {})
    problems = _problems(exc)
    if problems:
        first = problems[0]
        where = ".".join(str(part) for part in first["loc"])
        message = f"{where}: {first['msg']}"
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more)"
    else:
        message = "the request is invalid"
    error = {"message": message, "type": "RequestValidationError", "code": 422, "detail": problems}
    return ErrorResponse(422, {"error": error}, {})


async def validation_exception_handler(request: Request, exc: Exception) -> Response:
    """FastAPI's request validation error as a 422 in tether's error shape (a body that
    is not JSON at all: a 400); the first problem is the message, every problem is
    under ``error.detail`` as ``{"type", "loc", "msg"}``, without the input."""
    if not isinstance(exc, RequestValidationError):
        raise exc
    error = _validation_error(exc)
    return JSONResponse(error.body, error.status)


def add_exception_handlers(app: FastAPI, *, shape: Shape | None = None) -> None:
    """Answer FastAPI's validation errors and HTTP errors in tether's error shape.

    Opt-in: it replaces FastAPI's default handlers for
    :class:`~fastapi.exceptions.RequestValidationError` and
    :class:`~starlette.exceptions.HTTPException` on ``app`` (the latter through
    :func:`tether_starlette.json_errors`, which plain Starlette apps use).

    :param shape: rewrites each error before it is sent, given the request (another
        error shape on some routes, say); the default sends tether's.
    """
    json_errors(app, shape=shape)
    if shape is None:
        app.add_exception_handler(RequestValidationError, validation_exception_handler)
        return

    async def shaped(request: Request, exc: Exception) -> Response:
        if not isinstance(exc, RequestValidationError):
            raise exc
        error = shape(request, _validation_error(exc))
        return JSONResponse(error.body, error.status, headers=error.headers)

    app.add_exception_handler(RequestValidationError, shaped)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` written in place: the OpenAPI document
    resolves ``#/$defs/...`` against its own root, where they are not."""
    definitions = schema.get("$defs", {})

    def inline(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise TypeError(f"{name} is recursive: pass its schema as a dict instead")
            return inline(definitions[name], (*seen, name))
        return {key: inline(value, seen) for key, value in node.items() if key != "$defs"}

    inlined: dict[str, Any] = inline(schema, ())
    return inlined


def _schema(item: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    return _inlined(item.model_json_schema()) if isinstance(item, type) else item


def event_stream(
    item: type[BaseModel] | dict[str, Any] | None = None,
    *,
    json: type[BaseModel] | dict[str, Any] | None = None,
    status_code: int = 200,
) -> dict[str, Any]:
    """Decorator arguments that document an endpoint answering with ``respond()`` as
    what it sends: ``text/event-stream`` whose events' ``data`` is ``item`` as JSON
    (FastAPI's own ``EventSourceResponse`` is documented the same way), and, when it
    answers one JSON body too (``streaming=False``), ``application/json`` with
    ``json``'s schema::

        @app.post("/generate", **event_stream(Token, json=Result))
        async def generate(...) -> Response:
            return await respond(request, stream, streaming=body.stream)

    The path operation must return a response (``respond()``'s): the arguments set
    ``response_class`` to a bare ``Response``, so that FastAPI adds no JSON schema of
    its own. ``data: [DONE]``, pings and error events are tether's, not items.

    :param item: a pydantic model (or a JSON schema) of one streamed output.
    :param json: a pydantic model (or a JSON schema) of the JSON answer, if any.
    :param status_code: the status the endpoint answers with.
    :returns: ``response_class`` and ``responses`` for the route decorator.
    :raises TypeError: a model is recursive (pass its schema as a dict).
    """
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json"}
    if item is not None:
        data["contentSchema"] = _schema(item)
    events_schema = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": data,
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }
    content: dict[str, Any] = {"text/event-stream": {"itemSchema": events_schema}}
    if json is not None:
        content["application/json"] = {"schema": _schema(json)}
    description = "Server-sent events, ending with data: [DONE]"
    if json is not None:
        description += "; or one JSON body"
    return {
        "response_class": Response,
        "responses": {status_code: {"description": description, "content": content}},
    }


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
