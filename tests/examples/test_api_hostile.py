"""The example API refuses hostile input at the door: before anything is registered,
with the status a client can act on, and without echoing what it cannot encode."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import pytest
from api import (
    MAX_BODY_BYTES,
    MAX_ID_CHARS,
    MAX_NESTING,
    BadRequest,
    ClientGone,
    parse_generate,
    read_body,
    rejection,
)
from openai_api import parse_completions

LONE = "\\ud800"  # as a client sends it: a JSON escape, since it has no UTF-8 form


def escaped(template: str) -> bytes:
    """A JSON body written by hand, where ``LONE`` stands for a lone surrogate escape."""
    return template.replace("LONE", LONE).encode()


@pytest.mark.parametrize(
    ("parse", "raw"),
    [
        pytest.param(parse_generate, escaped('{"text": "aLONEb"}'), id="text"),
        pytest.param(parse_generate, escaped('{"text": ["ok", "LONE"]}'), id="text-batch"),
        pytest.param(parse_generate, escaped('{"text": "ok", "rid": "LONE"}'), id="rid"),
        pytest.param(
            parse_generate, escaped('{"text": ["a", "b"], "rid": ["x", "LONE"]}'), id="rid-batch"
        ),
        pytest.param(parse_generate, escaped('{"text": "ok", "LONE": 1}'), id="unknown-key"),
        pytest.param(parse_generate, escaped('{"text": "ok", "x": [{"y": "LONE"}]}'), id="deep"),
        pytest.param(parse_generate, b'{"text": "\xed\xa0\x80"}', id="text-utf8-bytes"),
        pytest.param(parse_completions, escaped('{"prompt": "LONE"}'), id="prompt"),
        pytest.param(parse_completions, escaped('{"prompt": ["LONE"]}'), id="prompt-batch"),
        pytest.param(parse_completions, escaped('{"prompt": "ok", "model": "LONE"}'), id="model"),
        pytest.param(
            parse_completions, escaped('{"prompt": "ok", "user": "LONE"}'), id="ignored-field"
        ),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_body_is_refused_with_422(
    parse: Callable[[bytes], object], raw: bytes
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(raw)
    assert caught.value.status == 422
    # The refusal itself must be encodable as UTF-8: it never echoes the surrogate.
    json.dumps(rejection(caught.value).body, ensure_ascii=False).encode()


def test_a_surrogate_pair_is_text_and_is_accepted() -> None:
    request = parse_generate(b'{"text": "\\ud83d\\ude00", "rid": "\\ud83d\\ude00"}')
    assert request.prompts == ("\N{GRINNING FACE}",)
    assert request.rids == ("\N{GRINNING FACE}",)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="top-level-100000"),
        pytest.param(b'{"text": ' + b"[" * 5000 + b"]" * 5000 + b"}", id="in-a-field-5000"),
        pytest.param(
            b'{"text": "x", "extra": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2000 + b"}",
            id="objects-in-an-ignored-field",
        ),
        pytest.param(
            b'{"text": "x", "extra": ' + b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1) + b"}",
            id="just-past-the-bound",
        ),
    ],
)
def test_deeply_nested_json_is_refused_with_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_generate(raw)
    assert caught.value.status == 400
    assert "nested" in caught.value.message


def test_nesting_up_to_the_bound_is_accepted() -> None:
    depth = MAX_NESTING - 1  # the body object is one level
    raw = b'{"text": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    assert parse_generate(raw).prompts == ("x",)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(b'{"text": "x", "max_tokens": 1e400}', 422, id="max-tokens-overflows-float"),
        pytest.param(b'{"text": "x", "timeout": 1e400}', 422, id="timeout-overflows-float"),
        pytest.param(b'{"text": "x", "timeout": 1e-400}', 422, id="timeout-underflows-to-zero"),
        pytest.param(b'{"text": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, id="5000-digits"),
        pytest.param(b'{"text": "x", "timeout": ' + b"9" * 4000 + b"}", 422, id="4000-digits"),
        pytest.param(b'{"text": "x", "max_tokens": NaN}', 400, id="nan"),
        pytest.param(b'{"text": "x", "timeout": Infinity}', 400, id="infinity"),
        pytest.param(b'{"text": "x", "timeout": -Infinity}', 400, id="minus-infinity"),
    ],
)
def test_huge_and_non_finite_numbers_get_a_4xx(raw: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_generate(raw)
    assert caught.value.status == status


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        pytest.param({"text": "x", "rid": "a\nb"}, 422, id="rid-newline"),
        pytest.param({"text": "x", "rid": "a\x00b"}, 422, id="rid-nul"),
        pytest.param({"text": "x", "rid": "a\x85b"}, 422, id="rid-c1-control"),
        pytest.param({"text": "x", "rid": "r" * (MAX_ID_CHARS + 1)}, 422, id="rid-too-long"),
    ],
)
def test_request_ids_are_short_printable_names(fields: dict[str, object], status: int) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_generate(json.dumps(fields).encode())
    assert caught.value.status == status
    assert parse_generate(json.dumps({"text": "x", "rid": "r" * MAX_ID_CHARS}).encode()).rids


@pytest.mark.parametrize(
    "model",
    [
        pytest.param("", id="empty"),
        pytest.param("m" * (MAX_ID_CHARS + 1), id="too-long"),
        pytest.param("a\tb", id="control"),
    ],
)
def test_model_names_are_short_printable_names(model: str) -> None:
    # The model is echoed in every chunk of a stream: a long one multiplies the answer.
    with pytest.raises(BadRequest) as caught:
        parse_completions(json.dumps({"prompt": "x", "model": model}).encode())
    assert caught.value.status == 422


async def chunks(*parts: bytes, then: BaseException | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if then is not None:
        raise then


async def test_a_client_leaving_during_the_body_is_client_gone_not_an_error() -> None:
    lost = ConnectionResetError("Connection lost")
    with pytest.raises(ClientGone) as caught:
        await read_body(chunks(b'{"te', then=lost), "100", gone=(OSError,))
    assert caught.value.__cause__ is lost
    # what is not in ``gone`` is a real failure, and is not disguised
    with pytest.raises(ValueError, match="bug"):
        await read_body(chunks(b"{", then=ValueError("bug")), None, gone=(OSError,))


@pytest.mark.parametrize(
    ("declared", "refused"),
    [
        pytest.param(str(MAX_BODY_BYTES), False, id="at-the-limit"),
        pytest.param(str(MAX_BODY_BYTES + 1), True, id="past-the-limit"),
        pytest.param("0" * 50 + "12", False, id="leading-zeros"),
        pytest.param("9" * 5000, True, id="5000-digits"),
        pytest.param("\N{SUPERSCRIPT TWO}", False, id="unicode-digit"),
        pytest.param("-1", False, id="negative"),
        pytest.param(None, False, id="absent"),
    ],
)
async def test_a_declared_length_is_judged_without_trusting_its_form(
    declared: str | None, refused: bool
) -> None:
    if refused:
        with pytest.raises(BadRequest) as caught:
            await read_body(chunks(b"{}"), declared, gone=(OSError,))
        assert caught.value.status == 413
    else:
        assert await read_body(chunks(b"{}"), declared, gone=(OSError,)) == b"{}"
