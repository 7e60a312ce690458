"""The OpenAI-compatible routes of all three example servers, through the official
``openai`` SDK, each server a subprocess on 127.0.0.1: chat and text completions
(streamed and not, ``n`` choices), usage, ``/v1/models``, and refusals in OpenAI's
error shape that the SDK turns into its own exception types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import openai
import pytest
import pytest_asyncio
from engine import chat_prompt, expected_text, prompt_tokens

from .conftest import Served, eventually, served

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVERS: Final = ("starlette", "fastapi", "aiohttp")
BOUND: Final = 10.0
HELLO: Final = [{"role": "user", "content": "hello there"}]
HELLO_PROMPT: Final = chat_prompt([("user", "hello there")])


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS)
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    async with served(request.param, "--step-ms", "2") as running:
        yield running
    assert running.failure_lines() == [], "\n".join(running.output)


@pytest_asyncio.fixture(loop_scope="module")
async def client(server: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=BOUND
    )
    yield sdk
    await sdk.close()
    # whatever the test did, nothing is left in flight on the server
    async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as http:

        async def idle() -> bool:
            return bool((await http.get("/health")).json()["in_flight"] == 0)

        await eventually(idle)


def assert_openai_error(body: object, *, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: the SDK hands over ``error``'s members as ``body``."""
    assert isinstance(body, dict), body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert isinstance(body["message"], str)
    assert body["message"]
    assert body["type"] in ("invalid_request_error", "server_error"), body
    assert body["param"] == param, body
    return body


async def test_models_list_names_the_model_the_servers_answer_as(
    client: openai.AsyncOpenAI,
) -> None:
    models = [model async for model in client.models.list()]
    assert [model.id for model in models] == ["tether-sim"]
    assert models[0].object == "model"


async def test_a_chat_completion_answers_in_one_body_with_usage(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.chat.completions.create(
        model="tether-sim", messages=HELLO, max_completion_tokens=7
    )
    assert answer.object == "chat.completion"
    assert answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(HELLO_PROMPT, 7)
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == prompt_tokens(HELLO_PROMPT)
    assert (answer.usage.completion_tokens, answer.usage.total_tokens) == (
        7,
        7 + prompt_tokens(HELLO_PROMPT),
    )


async def test_n_chat_choices_run_as_one_batch_each_with_its_index(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.chat.completions.create(
        model="tether-sim", messages=HELLO, max_tokens=4, n=3
    )
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert {choice.message.content for choice in answer.choices} == {expected_text(HELLO_PROMPT, 4)}
    assert answer.usage is not None
    # the prompt counts once, the three choices' tokens each
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        prompt_tokens(HELLO_PROMPT),
        12,
    )


@pytest.mark.parametrize("n", [1, 2], ids=["one-choice", "two-choices"])
async def test_a_streamed_chat_ends_with_the_usage_chunk_when_asked(
    client: openai.AsyncOpenAI, n: int
) -> None:
    stream = await client.chat.completions.create(
        model="tether-sim",
        messages=HELLO,
        max_tokens=9,
        n=n,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = [""] * n
    roles: list[list[str | None]] = [[] for _ in range(n)]
    chunks = [chunk async for chunk in stream]
    *deltas, last = chunks
    for chunk in deltas:
        assert chunk.object == "chat.completion.chunk"
        assert chunk.usage is None  # every chunk before the last says so
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index].append(choice.delta.role)
    assert texts == [expected_text(HELLO_PROMPT, 9)] * n
    # the role comes once per choice, on its first delta
    assert all(seen[0] == "assistant" and set(seen[1:]) <= {None} for seen in roles)
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        prompt_tokens(HELLO_PROMPT),
        9 * n,
    )
    assert len({chunk.id for chunk in chunks}) == 1


async def test_a_stream_without_include_usage_has_no_usage_chunk(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model="tether-sim", messages=HELLO, max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected_text(
        HELLO_PROMPT, 3
    )


async def test_text_completions_take_n_per_prompt_and_report_usage(
    client: openai.AsyncOpenAI,
) -> None:
    answer = await client.completions.create(
        model="tether-sim", prompt=["a b", "c"], max_tokens=3, n=2
    )
    # choice i * n + j: prompt i's choice j
    assert [choice.text for choice in answer.choices] == [
        expected_text(prompt, 3) for prompt in ("a b", "a b", "c", "c")
    ]
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 12)
    stream = await client.completions.create(
        model="tether-sim",
        prompt="hello",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks[:-1]) == expected_text("hello", 5)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


UNSUPPORTED: Final = {
    "logprobs": {"logprobs": 2},
    "echo": {"echo": True},
    "stop": {"stop": ["\n"]},
    "suffix": {"suffix": "end"},
    "best_of": {"best_of": 3},
    "logit_bias": {"logit_bias": {"50256": -100}},
    "made_up": {"made_up": 1},
}
"""A completions parameter the engine cannot honour, by the name a refusal must give."""


@pytest.mark.parametrize(("param", "extra"), UNSUPPORTED.items(), ids=UNSUPPORTED.keys())
async def test_a_completion_asking_for_what_the_engine_cannot_do_is_a_400_naming_it(
    client: openai.AsyncOpenAI, param: str, extra: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(
            model="tether-sim", prompt="x", max_tokens=2, extra_body=extra
        )
    body = assert_openai_error(raised.value.body, param=param)
    assert body["code"] == "unsupported_parameter"
    assert param in body["message"]


CHAT_REFUSALS: Final = {
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "response-format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "stop": ({"stop": "x"}, "stop"),
    "image-part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    "tool-message-field": (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
        "messages[0].tool_calls",
    ),
    "usage-without-stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "n-too-large": ({"n": 1000}, "n"),
    "zero-tokens": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "both-token-limits": ({"max_tokens": 2, "max_completion_tokens": 3}, "max_tokens"),
    "no-messages": ({"messages": []}, "messages"),
    "model-not-a-string": ({"model": 5}, "model"),
}
"""A chat request the server refuses, and the parameter its refusal must name."""


@pytest.mark.parametrize(("fields", "param"), CHAT_REFUSALS.values(), ids=CHAT_REFUSALS.keys())
async def test_a_chat_the_server_cannot_honour_is_a_bad_request_naming_the_parameter(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    body = {"model": "tether-sim", "messages": HELLO, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        await client.post("/chat/completions", body=body, cast_to=httpx.Response)
    assert raised.value.status_code == 400  # (/generate would say 422: OpenAI says 400)
    assert_openai_error(raised.value.body, param=param)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"stop": None, "logprobs": False, "tools": []}, id="off-values"),
        pytest.param({"temperature": 0.7, "top_p": 0.9, "seed": 3}, id="sampling"),
        pytest.param({"response_format": {"type": "text"}}, id="text-format"),
    ],
)
async def test_parameters_that_ask_for_nothing_the_engine_lacks_are_accepted(
    client: openai.AsyncOpenAI, fields: dict[str, Any]
) -> None:
    answer = await client.chat.completions.create(
        model="tether-sim", messages=HELLO, max_tokens=2, extra_body=fields
    )
    assert answer.choices[0].message.content == expected_text(HELLO_PROMPT, 2)


async def test_malformed_json_is_a_bad_request_without_a_character_offset(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = await http.post(
                path, content=b'{"prompt": ', headers={"content-type": "application/json"}
            )
            assert answer.status_code == 400
            body = assert_openai_error(answer.json()["error"])
            assert "line 1 column 12" in body["message"]
            assert "char" not in body["message"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nowhere", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
    ],
)
async def test_unknown_openai_routes_and_methods_answer_in_openais_shape(
    server: Served, method: str, path: str, status: int
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=BOUND) as http:
        answer = await http.request(method, path)
    assert answer.status_code == status
    assert_openai_error(answer.json()["error"])
    if status == 405:
        assert "Allow" in answer.headers


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SERVERS)
async def failing(request: pytest.FixtureRequest) -> AsyncIterator[openai.AsyncOpenAI]:
    """A server whose engine fails every request part-way (its failures are logged)."""
    async with served(request.param, "--step-ms", "2", "--fail-fraction", "1") as running:
        sdk = openai.AsyncOpenAI(
            base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=BOUND
        )
        yield sdk
        await sdk.close()


async def test_an_engine_failure_reaches_the_sdk_in_openais_shape(
    failing: openai.AsyncOpenAI,
) -> None:
    # max_tokens=1: the failure comes before the first output, as a status and a body
    with pytest.raises(openai.InternalServerError) as raised:
        await failing.chat.completions.create(model="tether-sim", messages=HELLO, max_tokens=1)
    body = assert_openai_error(raised.value.body)
    assert body["type"] == "server_error"
    # a long stream fails part-way: one error event, and no usage chunk after it
    stream = await failing.chat.completions.create(
        model="tether-sim",
        messages=HELLO,
        max_tokens=4000,
        stream=True,
        stream_options={"include_usage": True},
    )
    seen: list[Any] = []

    async def read_all() -> None:
        async for chunk in stream:
            seen.append(chunk)

    with pytest.raises(openai.APIError) as failed:
        await read_all()
    assert seen, "the failure came before the first output"
    assert all(chunk.choices for chunk in seen)
    assert assert_openai_error(failed.value.body)["type"] == "server_error"
    assert "simulated" not in json.dumps(failed.value.body)  # a producer's text is logged only


async def test_the_fastapi_example_documents_its_bodies_and_event_streams() -> None:
    async with (
        served("fastapi") as running,
        httpx.AsyncClient(base_url=running.url, timeout=BOUND) as http,
    ):
        paths = (await http.get("/openapi.json")).json()["paths"]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        operation = paths[path]["post"]
        assert "application/json" in operation["requestBody"]["content"], path
        answers = operation["responses"]["200"]["content"]
        assert "itemSchema" in answers["text/event-stream"], path
    item = paths["/generate"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert "meta_info" in item["itemSchema"]["properties"]["data"]["contentSchema"]["properties"]
