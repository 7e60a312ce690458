"""The example API's framework-neutral layer: validation and statuses (the OpenAI
routes' are in ``test_openai_api.py``)."""

from __future__ import annotations

import json

import pytest
from api import (
    MAX_BATCH,
    MAX_BODY_BYTES,
    BadRequest,
    Generation,
    Service,
    parse_generate,
    rejection,
)
from engine import Engine, expected_text, merge_outputs

import tether


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_generate_accepts_one_prompt_or_a_batch() -> None:
    single = parse_generate(body(text="hi", max_tokens=3, stream=True))
    assert single == Generation(prompts=("hi",), batched=False, max_tokens=3, stream=True)
    batch = parse_generate(body(text=["a", "b"], rid=["x", "y"]))
    assert (batch.prompts, batch.batched, batch.stream, batch.rids) == (
        ("a", "b"),
        True,
        False,
        ("x", "y"),
    )


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        pytest.param(b"{not json", 400, id="malformed-json"),
        pytest.param(b"\xff\xfe", 400, id="not-utf8"),
        pytest.param(b"[1, 2]", 422, id="not-an-object"),
        pytest.param(body(max_tokens=3), 422, id="missing-text"),
        pytest.param(body(text=7), 422, id="text-wrong-type"),
        pytest.param(body(text=["a", 1]), 422, id="batch-item-wrong-type"),
        pytest.param(body(text=[]), 422, id="empty-batch"),
        pytest.param(body(text=["a"] * (MAX_BATCH + 1)), 413, id="oversized-batch"),
        pytest.param(b" " * (MAX_BODY_BYTES + 1), 413, id="oversized-body"),
        pytest.param(body(text="a", max_tokens=0), 422, id="zero-max-tokens"),
        pytest.param(body(text="a", max_tokens=-3), 422, id="negative-max-tokens"),
        pytest.param(body(text="a", max_tokens=True), 422, id="boolean-max-tokens"),
        pytest.param(body(text="a", max_tokens="5"), 422, id="string-max-tokens"),
        pytest.param(body(text="a", stream="yes"), 422, id="stream-wrong-type"),
        pytest.param(body(text=["a", "b"], rid=["x", "x"]), 422, id="repeated-rid"),
        pytest.param(body(text=["a", "b"], rid=["x"]), 422, id="rid-count-mismatch"),
        pytest.param(body(text="a", rid=""), 422, id="empty-rid"),
        pytest.param(body(text="a", timeout=0), 422, id="zero-timeout"),
        pytest.param(body(text="a", timeout="1"), 422, id="string-timeout"),
        pytest.param(b'{"text": "a", "text": "b"}', 400, id="repeated-key"),
        pytest.param(b'{"text": "a", "x": {"k": 1, "k": 2}}', 400, id="repeated-inner-key"),
    ],
)
def test_generate_refuses_bad_bodies_with_their_status(raw: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_generate(raw)
    assert caught.value.status == status
    assert rejection(caught.value).body["error"]["code"] == status


async def test_service_registers_and_submits_then_tether_errors_map_to_statuses() -> None:
    engine = Engine()
    registry = tether.Registry(on_abort=engine.abort, merge=merge_outputs, max_in_flight=2)
    service = Service(engine, registry)
    async with engine.running(registry):
        batch = service.open(parse_generate(body(text=["a", "b"], max_tokens=2)))
        with pytest.raises(tether.Overloaded) as caught:
            service.open(parse_generate(body(text="c")))
        assert rejection(caught.value).status == 503
        assert service.stats()["in_flight"] == 2
        results = await batch.result()
    assert [result["text"] for result in results] == [expected_text(p, 2) for p in "ab"]
    assert service.stats()["engine"]["finished"] == 2
    assert service.health() == (200, {"status": "ok", "in_flight": 0})
