"""The OpenAI routes' framework-neutral layer: what is refused and how it is worded,
the stream's chunks, and errors in OpenAI's shape (the servers: ``test_openai.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api import BadRequest
from engine import output
from openai_api import Chunks, parse_chat, parse_completions, rejection, reshaped

import tether
from tether.http import ErrorResponse


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def events(frames: bytes) -> list[Any]:
    data = [part.removeprefix("data: ") for part in frames.decode().split("\n\n") if part]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def test_a_client_key_is_named_back_escaped_and_cut_short() -> None:
    key = "\x1b[31m" + "k" * 500
    with pytest.raises(BadRequest) as caught:
        parse_completions(json.dumps({"prompt": "x", key: 1}).encode())
    param = caught.value.param
    assert param is not None
    assert "\x1b" not in param
    assert len(param) <= 40
    assert rejection(caught.value).body["error"]["param"] == param


def test_n_choices_of_each_prompt_run_in_choice_order() -> None:
    call = parse_completions(body(prompt=["a", "b"], n=2, max_tokens=3))
    assert call.generation.prompts == ("a", "a", "b", "b")
    assert call.generation.batched
    assert call.prompts == ("a", "b")  # the usage counts each prompt once


def test_one_chat_choice_is_a_stream_and_two_are_a_batch() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert not parse_chat(body(messages=messages)).generation.batched
    assert parse_chat(body(messages=messages, n=2)).generation.batched


def test_a_chat_choice_carries_its_role_once_whatever_the_framing() -> None:
    call = parse_chat(body(messages=[{"role": "user", "content": "x"}], n=2, stream=True))
    encoder = Chunks(call, "chatcmpl-1")
    frames = encoder.encode_indexed(
        [(1, output("r", " a", 1, None)), (0, output("q", " b", 1, None))]
    )
    frames += encoder.encode_indexed([(1, output("r", " c", 2, "length"))])
    deltas = [
        (chunk["choices"][0]["index"], chunk["choices"][0]["delta"]) for chunk in events(frames)
    ]
    assert deltas == [
        (1, {"role": "assistant", "content": " a"}),
        (0, {"role": "assistant", "content": " b"}),
        (1, {"content": " c"}),
    ]


def test_a_failed_stream_ends_with_an_openai_error_event_and_no_usage() -> None:
    call = parse_completions(body(prompt="x", stream=True, stream_options={"include_usage": True}))
    encoder = Chunks(call, "cmpl-1")
    first = encoder.encode_many([output("r", " a", 1, None)])
    failure = tether.http.error_response(tether.RequestTimeout("r", 0.5)).body
    end = encoder.error(failure) + encoder.terminal()
    *_, error, done = events(first + end)
    assert done == "[DONE]"
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "server_error"
    assert error["error"]["message"] == failure["error"]["message"]


def test_a_finished_stream_with_include_usage_ends_with_the_usage_chunk() -> None:
    call = parse_completions(
        body(prompt="one two", stream=True, stream_options={"include_usage": True})
    )
    encoder = Chunks(call, "cmpl-1")
    frames = encoder.encode_many([output("r", " a", 1, None), output("r", " b", 2, "length")])
    *chunks, last, done = events(frames + encoder.terminal())
    assert done == "[DONE]"
    assert all(chunk["usage"] is None for chunk in chunks)
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_tethers_errors_keep_their_status_and_headers_in_openais_shape() -> None:
    refused = rejection(tether.Overloaded(4, retry_after=2.5))
    assert refused.status == 503
    assert refused.headers == {"retry-after": "3"}
    assert refused.body["error"]["type"] == "server_error"
    validation = reshaped(ErrorResponse(422, {"error": {"message": "bad", "code": 422}}, {}))
    assert validation.status == 400
    assert validation.body["error"]["type"] == "invalid_request_error"


def test_a_body_too_large_stays_413_and_a_field_fault_is_400() -> None:
    assert rejection(BadRequest(413, "too large")).status == 413
    assert rejection(BadRequest(413, "65 prompts", param="prompt")).status == 400
    assert rejection(BadRequest(422, "lone surrogate")).status == 400
