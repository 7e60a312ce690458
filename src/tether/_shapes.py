"""Framework errors and streaming endpoints described in tether's terms, for adapters.

A framework's own errors (404, 405, 413, a request that failed validation) become
tether's ``{"error": {"message", "type", "code"}}`` through :func:`http_error` and
:func:`validation_error`, so that every adapter answers them alike; what a client
sent is never echoed back (it may be ``NaN``, a lone surrogate or a megabyte).
:func:`event_stream_responses` is the OpenAPI description of a ``respond()``
endpoint; it needs no web framework (a pydantic model is read by its
``model_json_schema()``).
"""

from __future__ import annotations

import http
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

from ._responses import ErrorResponse

__all__ = ["Schema", "event_stream_responses", "http_error", "validation_error"]

_NOT_TEXT: Final = re.compile(r"[\ud800-\udfff]")
_MAX_SHOWN: Final = 80
"""Characters of a client's own key (in an error's ``loc``) shown back to it."""


def http_error(status: int, detail: Any, headers: Mapping[str, str]) -> ErrorResponse:
    """A framework's HTTP error (``detail``: its message, or any JSON value, which then
    goes under ``error.detail`` with the status phrase as the message)."""
    error: dict[str, Any] = {"message": detail, "type": "HTTPException", "code": status}
    if not isinstance(detail, str):
        error["message"] = http.HTTPStatus(status).phrase
        error["detail"] = detail
    return ErrorResponse(status, {"error": error}, dict(headers))


def _shown(part: Any) -> str | int:
    # A loc names the place with the client's own keys: printable, short, encodable.
    if isinstance(part, int) and not isinstance(part, bool):
        return part
    text = _NOT_TEXT.sub("\ufffd", str(part))
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def validation_error(errors: Iterable[Mapping[str, Any]]) -> ErrorResponse:
    """Validation problems (pydantic's ``{"type", "loc", "msg", ...}``) as a 422 whose
    message is the first problem and whose ``error.detail`` lists each as ``{"type",
    "loc", "msg"}``, never its ``input`` nor its ``ctx``; a body that is not JSON at
    all (a ``json_invalid`` problem) is a 400."""
    errors = list(errors)
    if any(error.get("type") == "json_invalid" for error in errors):
        # The loc is ("body", <character offset>): not a place a client can fix.
        reason = errors[0].get("ctx", {}).get("error", "")
        message = "the request body is not valid JSON"
        if isinstance(reason, str) and reason:
            message += f": {_shown(reason)}"
        detail = [{"type": "json_invalid", "loc": ["body"], "msg": message}]
        error = {"message": message, "type": "RequestValidationError", "code": 400}
        return ErrorResponse(400, {"error": {**error, "detail": detail}}, {})
    problems = [
        {
            "type": str(error.get("type", "")),
            "loc": [_shown(part) for part in error.get("loc", ())],
            "msg": str(_shown(error.get("msg", "invalid"))),
        }
        for error in errors
    ]
    message = "the request is invalid"
    if problems:
        first = problems[0]
        message = ".".join(str(part) for part in first["loc"]) + f": {first['msg']}"
        if len(problems) > 1:
            message += f" (and {len(problems) - 1} more)"
    error = {"message": message, "type": "RequestValidationError", "code": 422, "detail": problems}
    return ErrorResponse(422, {"error": error}, {})


class Model(Protocol):
    """A pydantic model class, as far as a schema goes."""

    def model_json_schema(self) -> dict[str, Any]: ...


Schema = Model | dict[str, Any]
"""A pydantic model (class) or a JSON schema."""


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with its ``$defs`` written in place: an OpenAPI document resolves
    ``#/$defs/...`` against its own root, where they are not."""
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


def _schema(item: Schema) -> dict[str, Any]:
    return item if isinstance(item, dict) else _inlined(item.model_json_schema())


def event_stream_responses(
    item: Schema | None = None, *, json: Schema | None = None, status_code: int = 200
) -> dict[int, Any]:
    """The OpenAPI ``responses`` of an endpoint answering with ``respond()``: a
    ``text/event-stream`` whose events' ``data`` is ``item`` as JSON and, with
    ``json``, an ``application/json`` body of that schema.

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
    description = "Server-sent events, ending with data: [DONE]"
    if json is not None:
        content["application/json"] = {"schema": _schema(json)}
        description += "; or one JSON body"
    return {status_code: {"description": description, "content": content}}
