"""``event_stream()`` documents an endpoint that answers with ``respond()`` as what it
sends: ``text/event-stream`` with the item schema (as FastAPI documents its own
``EventSourceResponse``), and the JSON body's schema when it answers one too."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.sse import EventSourceResponse
from pydantic import BaseModel

from tether_starlette.fastapi import event_stream


class Meta(BaseModel):
    tokens: int


class Token(BaseModel):
    text: str
    meta: Meta


class Result(BaseModel):
    texts: list[str]


class Node(BaseModel):
    children: list[Node]


def documented(**route: Any) -> dict[str, Any]:
    """The OpenAPI operation of ``POST /x`` declared with ``route``."""
    app = FastAPI()

    @app.post("/x", **route)
    async def endpoint(request: Request) -> Response:
        return Response(b"")

    operation: dict[str, Any] = app.openapi()["paths"]["/x"]["post"]
    return operation


def test_a_streaming_endpoint_is_documented_as_events_of_its_item_not_as_json() -> None:
    content = documented(**event_stream(Token))["responses"]["200"]["content"]
    assert list(content) == ["text/event-stream"]  # no empty application/json schema
    data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert data["contentMediaType"] == "application/json"
    schema = data["contentSchema"]
    assert schema["properties"]["text"] == {"title": "Text", "type": "string"}
    # the nested model is written in place: no "#/$defs" the document cannot resolve
    assert schema["properties"]["meta"]["properties"]["tokens"]["type"] == "integer"
    assert "$ref" not in str(schema)


def test_the_item_schema_has_the_shape_fastapis_own_event_source_response_has() -> None:
    app = FastAPI()

    @app.post("/native", response_class=EventSourceResponse)
    async def native() -> Any:  # (FastAPI documents the yielded item type)
        yield Token(text="a", meta=Meta(tokens=1))

    native_item = app.openapi()["paths"]["/native"]["post"]["responses"]["200"]["content"][
        "text/event-stream"
    ]["itemSchema"]
    ours = documented(**event_stream(Token))["responses"]["200"]["content"]
    item = ours["text/event-stream"]["itemSchema"]
    assert set(item["properties"]) == set(native_item["properties"])
    assert item["properties"]["data"]["type"] == native_item["properties"]["data"]["type"]


def test_an_endpoint_that_also_answers_json_documents_both() -> None:
    content = documented(**event_stream(Token, json=Result))["responses"]["200"]["content"]
    assert set(content) == {"text/event-stream", "application/json"}
    assert content["application/json"]["schema"]["properties"]["texts"]["type"] == "array"


def test_schemas_given_as_dicts_are_used_as_they_are() -> None:
    content = documented(**event_stream({"type": "string"}))["responses"]["200"]["content"]
    data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
    assert data["contentSchema"] == {"type": "string"}


def test_a_recursive_model_is_refused_with_a_way_out() -> None:
    with pytest.raises(TypeError, match="pass its schema as a dict"):
        event_stream(Node)
