"""SSE and NDJSON framing, batch index tagging and the JSON serialisers."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys

import orjson
import pydantic
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
    assert getattr(default_dumps, "func", None) is orjson.dumps


class Point(pydantic.BaseModel):
    x: int
    at: datetime.date


@pytest.mark.parametrize("dumps", [_stdlib_dumps, default_dumps], ids=["stdlib", "orjson"])
def test_pydantic_models_are_written_as_their_json_dump(dumps: tether.types.Dumps) -> None:
    value = {"points": [Point(x=1, at=datetime.date(2026, 12, 1))]}
    assert json.loads(dumps(value)) == {"points": [{"x": 1, "at": "2026-12-01"}]}


@pytest.mark.parametrize("dumps", [_stdlib_dumps, default_dumps], ids=["stdlib", "orjson"])
def test_values_of_unknown_types_still_fail_to_serialise(dumps: tether.types.Dumps) -> None:
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_importing_tether_does_not_import_pydantic() -> None:
    code = "import sys, tether, tether.http; print('pydantic' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


class Tagged(tether.SSE):
    """Overrides only encode(): every frame gets an event name."""

    __slots__ = ()

    def encode(self, output: object) -> bytes:
        return b"event: out\n" + super().encode(output)


def test_overriding_encode_changes_every_frame_of_a_chunk() -> None:
    tagged = Tagged()
    assert tagged.encode_many([1, 2]) == b"event: out\ndata: 1\n\nevent: out\ndata: 2\n\n"
    assert tagged.encode_indexed([(0, "a")]) == b'event: out\ndata: {"index":0,"output":"a"}\n\n'
    assert tagged.error({"error": {}}) == b'data: {"error":{}}\n\n'  # not an output


def test_a_transform_shapes_outputs_but_not_errors() -> None:
    sse = tether.SSE(transform=lambda output: output * 2)
    assert sse.encode_many([1, 2]) == b"data: 2\n\ndata: 4\n\n"
    assert sse.encode_indexed([(3, 5)]) == b'data: {"index":3,"output":10}\n\n'
    assert sse.error({"error": {"code": 1}}) == b'data: {"error":{"code":1}}\n\n'


def test_shaped_copies_the_encoder_and_composes_transforms() -> None:
    base = tether.NDJSON(transform=lambda output: output + 1)
    shaped = base.shaped(lambda output: output * 10)
    assert shaped.encode_many([1]) == b"20\n"
    assert base.encode_many([1]) == b"2\n"  # unchanged
    assert type(shaped) is tether.NDJSON


def test_a_custom_dumps_replaces_the_serialiser() -> None:
    def upper(value: object) -> bytes:
        return str(value).upper().encode()

    assert tether.NDJSON(dumps=upper).encode("abc") == b"ABC\n"
