"""SSE and NDJSON framing, batch index tagging and the JSON serialisers."""

from __future__ import annotations

import json

import orjson
import pytest

import tether
import tether.http
from tether._encoders import _stdlib_dumps, default_dumps


def test_sse_frames_outputs_terminal_and_ping() -> None:
    sse = tether.SSE()
    assert sse.encode({"text": "hi"}) == b'data: {"text":"hi"}\n\n'
    assert sse.encode_many([1, "two"]) == b'data: 1\n\ndata: "two"\n\n'
    assert sse.terminal() == b"data: [DONE]\n\n"
    assert sse.ping() == b": ping\n\n"
    assert tether.SSE.media_type == "text/event-stream"
    assert tether.SSE.headers["Cache-Control"] == "no-cache"


def test_sse_error_event_carries_the_error_body() -> None:
    body = tether.http.error_body(tether.RegistryClosed(), 503)
    frame = tether.SSE().error(body)
    assert frame.startswith(b"data: ")
    assert frame.endswith(b"\n\n")
    error = json.loads(frame[len(b"data: ") :])["error"]
    assert error == {"message": str(tether.RegistryClosed()), "type": "RegistryClosed", "code": 503}


def test_ndjson_frames_one_value_per_line_without_terminal() -> None:
    ndjson = tether.NDJSON()
    assert ndjson.encode_many([{"a": 1}, [2]]) == b'{"a":1}\n[2]\n'
    assert ndjson.terminal() == b""
    assert ndjson.ping() == b"\n"
    assert tether.NDJSON.media_type == "application/x-ndjson"


@pytest.mark.parametrize("encoder", [tether.SSE(), tether.NDJSON()], ids=["sse", "ndjson"])
def test_batch_outputs_are_tagged_with_their_index(encoder: tether.Encoder) -> None:
    data = encoder.encode_indexed([(0, {"text": "a"}), (1, "b")])
    lines = [line for line in data.split(b"\n") if line]
    values = [json.loads(line.removeprefix(b"data: ")) for line in lines]
    assert values == [{"index": 0, "text": "a"}, {"index": 1, "output": "b"}]
    assert list(values[0]) == ["index", "text"]  # the index comes first


@pytest.mark.parametrize("dumps", [_stdlib_dumps, orjson.dumps], ids=["stdlib", "orjson"])
def test_both_serialisers_write_compact_utf8_json(dumps: tether.types.Dumps) -> None:
    value = {"text": "héllo ✓", "n": [1, 2]}
    encoded = dumps(value)
    assert encoded == '{"text":"héllo ✓","n":[1,2]}'.encode()
    assert tether.SSE(dumps=dumps).encode(value) == b"data: " + encoded + b"\n\n"


def test_orjson_is_the_default_when_installed() -> None:
    assert default_dumps is orjson.dumps


def test_a_custom_dumps_replaces_the_serialiser() -> None:
    def upper(value: object) -> bytes:
        return str(value).upper().encode()

    assert tether.NDJSON(dumps=upper).encode("abc") == b"ABC\n"
