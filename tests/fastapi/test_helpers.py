"""FastAPI as a first-class citizen: the registry as a dependency, FastAPI's own
errors in tether's error shape, and shaping what ``respond()`` writes (a
``transform``, pydantic outputs, an encoder's ``encode()``), on a real uvicorn."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

import tether
from tests.starlette.conftest import BOUND, serve
from tether_starlette import TetherMiddleware, respond
from tether_starlette.fastapi import RegistryDep, add_exception_handlers


class Token(BaseModel):
    text: str
    logprob: float = 0.0


class Ask(BaseModel):
    words: list[str]
    stream: bool = False
    batch: bool = False
    pydantic: bool = False


class Framed(tether.SSE):
    """An encoder that overrides only ``encode()``: its frames carry an event name."""

    __slots__ = ()

    def encode(self, output: Any) -> bytes:
        return b"event: token\n" + super().encode(output)


def make_app(
    registry: tether.Registry,
    *,
    transform: Callable[[Any], Any] | None = None,
    encoder: tether.Encoder | None = None,
    handlers: bool = True,
) -> FastAPI:
    """``POST /ask`` answers with the words as outputs, delivered up front (the
    producer is the handler itself: what is tested here is what gets written)."""
    app = FastAPI()
    app.add_middleware(TetherMiddleware, registry=registry)
    if handlers:
        add_exception_handlers(app)

    @app.post("/ask")
    async def ask(body: Ask, request: Request, registry: RegistryDep) -> Response:
        def output(word: str) -> Any:
            return Token(text=word) if body.pydantic else {"text": word}

        if body.batch:
            batch = registry.open_batch(len(body.words))
            for rid, word in zip(batch.rids, body.words, strict=True):
                registry.deliver(rid, output(word), finished=True)
            return await respond(request, batch, streaming=body.stream, transform=transform)
        stream = registry.open()
        for index, word in enumerate(body.words):
            registry.deliver(stream.rid, output(word), finished=index == len(body.words) - 1)
        return await respond(
            request, stream, streaming=body.stream, transform=transform, encoder=encoder
        )

    @app.get("/in_flight")
    async def in_flight(registry: RegistryDep) -> dict[str, int]:
        return {"in_flight": registry.in_flight}

    return app


def data_events(text: str) -> list[Any]:
    return [
        line.removeprefix("data: ")
        if line == "data: [DONE]"
        else json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


async def post(app: FastAPI, path: str, body: Any) -> httpx.Response:
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        return await client.post(f"{url}{path}", json=body)


async def test_the_registry_dependency_is_the_middlewares_registry() -> None:
    registry = tether.Registry()
    async with serve(make_app(registry)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        asked = await client.post(f"{url}/ask", json={"words": ["a", "b"]})
        counted = await client.get(f"{url}/in_flight")
    assert asked.json() == {"text": "b"}  # (no merge: the last output, see the README)
    assert counted.json() == {"in_flight": 0}
    assert registry.stats().opened == 1


async def test_validation_errors_get_tethers_error_shape() -> None:
    answer = await post(make_app(tether.Registry()), "/ask", {"words": "not a list"})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == 422
    assert error["type"] == "RequestValidationError"
    assert error["message"].startswith("body.words: ")
    assert error["detail"][0]["loc"] == ["body", "words"]


HOSTILE: Final = {
    "nan": b'{"words": NaN}',
    "infinity-in-a-list": b'{"words": ["a", Infinity]}',
    "lone-surrogate-top-level": b'"\\ud800 and more"',
    "lone-surrogate-in-a-field": b'{"words": ["a"], "stream": "\\udfff"}',
    "lone-surrogate-value": b'{"words": "\\ud800"}',
    "huge-input": b'{"words": "' + b"x" * 200_000 + b'"}',
}
"""Bodies whose validation errors would carry an input FastAPI's own handler cannot
write (NaN, a lone surrogate) or should not echo (a large body)."""


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_validation_error_about_a_hostile_body_is_still_a_json_422(raw: bytes) -> None:
    registry = tether.Registry()
    async with serve(make_app(registry)) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        answer = await client.post(
            f"{url}/ask", content=raw, headers={"content-type": "application/json"}
        )
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["type"]) == (422, "RequestValidationError")
    assert all(set(problem) == {"type", "loc", "msg"} for problem in error["detail"])
    assert len(answer.content) < 2000  # the input is not echoed
    assert registry.in_flight == 0


async def test_a_body_that_is_not_json_is_a_400_without_a_character_offset() -> None:
    answer = await post_raw(make_app(tether.Registry()), "/ask", b'{"words": [1,')
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"].startswith("the request body is not valid JSON")
    assert error["detail"] == [{"type": "json_invalid", "loc": ["body"], "msg": error["message"]}]


async def post_raw(app: FastAPI, path: str, raw: bytes) -> httpx.Response:
    async with serve(app) as (url, _), httpx.AsyncClient(timeout=BOUND) as client:
        return await client.post(
            f"{url}{path}", content=raw, headers={"content-type": "application/json"}
        )


async def test_without_the_handlers_fastapi_keeps_its_own_shape() -> None:
    answer = await post(make_app(tether.Registry(), handlers=False), "/ask", {"words": 1})
    assert answer.status_code == 422
    assert "detail" in answer.json()
    assert "error" not in answer.json()


async def test_unknown_routes_get_tethers_error_shape() -> None:
    answer = await post(make_app(tether.Registry()), "/nowhere", {})
    assert answer.status_code == 404
    assert answer.json() == {
        "error": {"message": "Not Found", "type": "HTTPException", "code": 404}
    }


async def test_the_openai_client_shows_the_validation_message() -> None:
    app = make_app(tether.Registry())
    async with serve(app) as (url, _):
        client = openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=BOUND)
        with pytest.raises(openai.UnprocessableEntityError) as raised:
            await client.post("/ask", body={"words": 3}, cast_to=httpx.Response)
        await client.close()
    assert "body.words: " in str(raised.value)


async def test_a_transform_shapes_the_json_result_without_a_round_trip() -> None:
    seen: list[Any] = []

    def shape(result: Any) -> Any:
        seen.append(result)
        return {"answer": result["text"].upper()}

    answer = await post(make_app(tether.Registry(), transform=shape), "/ask", {"words": ["a", "b"]})
    assert answer.json() == {"answer": "B"}
    assert seen == [{"text": "b"}]  # the result itself, not JSON text


async def test_a_transform_of_a_batch_gets_the_list_of_results() -> None:
    def shape(results: list[Any]) -> Any:
        return {"texts": [result["text"] for result in results]}

    app = make_app(tether.Registry(), transform=shape)
    answer = await post(app, "/ask", {"words": ["a", "b", "c"], "batch": True})
    assert answer.json() == {"texts": ["a", "b", "c"]}


@pytest.mark.parametrize("batch", [False, True], ids=["stream", "batch"])
async def test_a_transform_shapes_each_streamed_output(batch: bool) -> None:
    app = make_app(tether.Registry(), transform=lambda output: output["text"] * 2)
    answer = await post(app, "/ask", {"words": ["a", "b"], "stream": True, "batch": batch})
    events = data_events(answer.text)
    if batch:
        assert sorted(events[:-1], key=lambda event: event["index"]) == [
            {"index": 0, "output": "aa"},
            {"index": 1, "output": "bb"},
        ]
    else:
        assert events[:-1] == ["aa", "bb"]
    assert events[-1] == "[DONE]"


async def test_a_transform_that_raises_fails_that_request_alone() -> None:
    def broken(result: Any) -> Any:
        raise ValueError("no")

    registry = tether.Registry()
    answer = await post(make_app(registry, transform=broken), "/ask", {"words": ["a"]})
    assert answer.status_code == 500
    assert "error" in answer.json()
    assert registry.in_flight == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_pydantic_models_as_outputs_are_written_as_json(stream: bool) -> None:
    answer = await post(
        make_app(tether.Registry()),
        "/ask",
        {"words": ["a", "b"], "pydantic": True, "stream": stream},
    )
    assert answer.status_code == 200, answer.text
    if stream:
        assert data_events(answer.text) == [
            {"text": "a", "logprob": 0.0},
            {"text": "b", "logprob": 0.0},
            "[DONE]",
        ]
    else:
        assert answer.json() == {"text": "b", "logprob": 0.0}


async def test_an_encoder_that_overrides_encode_frames_every_output() -> None:
    app = make_app(tether.Registry(), encoder=Framed())
    answer = await post(app, "/ask", {"words": ["a", "b"], "stream": True})
    assert answer.text.count("event: token\n") == 2
    assert data_events(answer.text) == [{"text": "a"}, {"text": "b"}, "[DONE]"]
