"""SSE and NDJSON framing, batch index tagging and the JSON serialisers."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import math
import subprocess
import sys
import uuid
from typing import Final

import orjson
import pydantic
import pytest

import tether
import tether.http
from tether._encoders import default_dumps, one_frame, stdlib_dumps


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
def test_batch_outputs_are_written_in_an_envelope_with_their_index(
    encoder: tether.Encoder,
) -> None:
    data = encoder.encode_indexed([(0, {"text": "a"}), (1, "b")])
    lines = [line for line in data.split(b"\n") if line]
    values = [json.loads(line.removeprefix(b"data: ")) for line in lines]
    assert values == [{"index": 0, "output": {"text": "a"}}, {"index": 1, "output": "b"}]
    assert list(values[0]) == ["index", "output"]  # the index comes first


@pytest.mark.parametrize("encoder", [tether.SSE(), tether.NDJSON()], ids=["sse", "ndjson"])
def test_an_output_of_its_own_index_never_overwrites_the_batch_index(
    encoder: tether.Encoder,
) -> None:
    """OpenAI-style choices carry their own "index": the sub-request's is the batch's."""
    pairs = [(0, {"index": 0, "text": "a"}), (1, {"index": 0, "text": "b"})]
    for data in (encoder.encode_indexed(pairs), encoder.shaped(lambda o: o).encode_indexed(pairs)):
        lines = [line for line in data.split(b"\n") if line]
        values = [json.loads(line.removeprefix(b"data: ")) for line in lines]
        assert [value["index"] for value in values] == [0, 1]
        assert [value["output"] for value in values] == [output for _, output in pairs]


@pytest.mark.parametrize("dumps", [stdlib_dumps, orjson.dumps], ids=["stdlib", "orjson"])
def test_both_serialisers_write_compact_utf8_json(dumps: tether.types.Dumps) -> None:
    value = {"text": "héllo ✓", "n": [1, 2]}
    encoded = dumps(value)
    assert encoded == '{"text":"héllo ✓","n":[1,2]}'.encode()
    assert tether.SSE(dumps=dumps).encode(value) == b"data: " + encoded + b"\n\n"


def test_orjson_is_the_default_when_installed() -> None:
    # The one spelling that tells them apart: orjson writes 1e-7, the stdlib 1e-07.
    assert default_dumps([1e-7]) == orjson.dumps([1e-7]) == b"[1e-7]"
    assert stdlib_dumps([1e-7]) == b"[1e-07]"


class Point(pydantic.BaseModel):
    x: int
    at: datetime.date


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


@dataclasses.dataclass
class Inner:
    when: datetime.date
    _private: str = "never written"


@dataclasses.dataclass
class Labelled:
    name: str


def _labelled_with_an_attribute_beyond_its_fields() -> Labelled:
    tagged = Labelled("t")
    tagged.note = "not a field"  # type: ignore[attr-defined]
    return tagged


@dataclasses.dataclass
class Outer:
    name: str
    inner: Inner
    tags: tuple[str, ...]


_UTC = datetime.UTC
_ZONE = datetime.timezone(datetime.timedelta(hours=5, minutes=30))
_LMT = datetime.timezone(datetime.timedelta(minutes=19, seconds=32))  # (Amsterdam before 1937)

ENCODED: Final = [
    pytest.param({"text": "héllo ✓ 😀", "n": [1, 2]}, id="non-ascii"),
    pytest.param([None, True, False, 0, -1, 2**63 - 1, -(2**63)], id="scalars"),
    pytest.param([0.1, 1.5, -2.25, 1e16, 12345.678], id="floats"),
    pytest.param([float("nan"), float("inf"), -float("inf")], id="non-finite-floats-as-null"),
    pytest.param({"x": float("nan")}, id="nan-in-a-dict"),
    pytest.param(2**64, id="int-past-64-bits"),
    pytest.param({1: "a", 2: "b"}, id="int-keys"),
    pytest.param(("a", ("b",)), id="tuples-as-lists"),
    pytest.param(datetime.datetime(2026, 12, 1, 20, 32, 4), id="naive-datetime"),
    pytest.param(datetime.datetime(2026, 12, 1, 20, 32, 4, 123456, tzinfo=_UTC), id="utc-datetime"),
    pytest.param(datetime.datetime(2026, 12, 1, 20, 32, tzinfo=_ZONE), id="zoned-datetime"),
    pytest.param(datetime.datetime(1930, 1, 1, tzinfo=_LMT), id="sub-minute-offset"),
    pytest.param(datetime.date(2026, 12, 1), id="date"),
    pytest.param(datetime.time(20, 32, 4, 5), id="time"),
    pytest.param(datetime.time(20, 32, tzinfo=_UTC), id="zoned-time"),
    pytest.param(uuid.UUID("12345678-1234-5678-1234-567812345678"), id="uuid"),
    pytest.param([Colour.RED, Level.HIGH], id="enums-as-values"),
    pytest.param(Outer("o", Inner(datetime.date(2026, 1, 2)), ("t",)), id="nested-dataclasses"),
    pytest.param(_labelled_with_an_attribute_beyond_its_fields(), id="dataclass-extra-attribute"),
    pytest.param({"points": [Point(x=1, at=datetime.date(2026, 12, 1))]}, id="pydantic"),
    pytest.param([[[[[[[[[[[]]]]]]]]]]] * 2, id="nested"),
    pytest.param(functools.reduce(lambda acc, _: [acc], range(300), []), id="deeper-than-orjson"),
]
REFUSED: Final = [
    pytest.param({1, 2}, id="set"),
    pytest.param(b"bytes", id="bytes"),
    pytest.param(object(), id="object"),
    pytest.param("lone \ud800 surrogate", id="lone-surrogate"),
    pytest.param({("a",): 1}, id="tuple-key"),
    pytest.param(functools.reduce(lambda acc, _: [acc], range(100_000), []), id="too-deep"),
]


def _stdlib_only(values: object) -> bytes:
    """What the standard library path writes in a process without orjson."""
    code = (
        "import pickle, sys; sys.modules['orjson'] = None\n"
        "from tether._encoders import default_dumps, stdlib_dumps\n"
        "assert default_dumps is stdlib_dumps\n"
        "sys.stdout.buffer.write(default_dumps(pickle.loads(sys.stdin.buffer.read())))"
    )
    import pickle

    result = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(values),
        capture_output=True,
        check=True,
        timeout=60,
    )
    return result.stdout


@pytest.mark.parametrize("value", ENCODED)
def test_a_value_is_written_the_same_with_and_without_orjson(value: object) -> None:
    written = stdlib_dumps(value)
    assert default_dumps(value) == written
    json.loads(written)  # valid JSON (no NaN)


@pytest.mark.parametrize("value", REFUSED)
def test_a_value_refused_is_refused_the_same_with_and_without_orjson(value: object) -> None:
    with pytest.raises(TypeError):
        stdlib_dumps(value)
    with pytest.raises(TypeError):
        default_dumps(value)


def test_the_stdlib_path_is_the_default_without_orjson_and_writes_the_same() -> None:
    values = [
        {"text": "héllo ✓ 😀"},
        [float("nan"), 2**64, {1: "a"}],
        datetime.datetime(2026, 12, 1, 20, 32, 4, 123456, tzinfo=_UTC),
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        tether.AbortReason.SERVER,
    ]
    assert _stdlib_only(values) == default_dumps(values)


@pytest.mark.parametrize("dumps", [stdlib_dumps, default_dumps], ids=["stdlib", "orjson"])
def test_pydantic_models_are_written_as_their_json_dump(dumps: tether.types.Dumps) -> None:
    value = {"points": [Point(x=1, at=datetime.date(2026, 12, 1))]}
    assert json.loads(dumps(value)) == {"points": [{"x": 1, "at": "2026-12-01"}]}


@pytest.mark.parametrize("dumps", [stdlib_dumps, default_dumps], ids=["stdlib", "orjson"])
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


class Framed(tether.NDJSON):
    """Overrides only frame(): every line is prefixed."""

    __slots__ = ()

    def frame(self, payload: bytes) -> bytes:
        return b"> " + super().frame(payload)


@pytest.mark.parametrize(
    "encoder",
    [tether.SSE(), tether.NDJSON(), tether.SSE(dumps=stdlib_dumps), Tagged(), Framed()],
    ids=["sse", "ndjson", "sse-stdlib", "own-encode", "own-frame"],
)
def test_the_one_output_write_frames_it_as_encode_does(encoder: tether.Encoder) -> None:
    single = one_frame(encoder)
    # (with orjson's refusals among them: an int past 64 bits, a non-str key, NaN)
    for output in ({"n": 1, "delta": "lorem"}, "é", [1.5, None], 7, 2**70, {1: "a"}, math.nan):
        assert single(output) == encoder.encode(output)
    for unwritable in ("\ud800", object()):  # neither way writes it: the same error
        with pytest.raises(TypeError):
            single(unwritable)
        with pytest.raises(TypeError):
            encoder.encode(unwritable)


@pytest.mark.parametrize("encoder_type", [tether.SSE, tether.NDJSON], ids=["sse", "ndjson"])
def test_streams_of_the_default_serialiser_share_one_write_function(
    encoder_type: type[tether.Encoder],
) -> None:
    # A function built per stream would live as long as the stream, idle or not.
    assert one_frame(encoder_type()) is one_frame(encoder_type())


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
