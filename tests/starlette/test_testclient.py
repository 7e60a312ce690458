"""Starlette's own ``TestClient`` (the way most apps test themselves: the app on an
anyio portal's loop in a thread) gets the same answers as a real server: a JSON
answer, a JSON answer to a request with a body, a stream; nothing aborted, freed."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from .conftest import Engine, make_app


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"),
    [
        pytest.param("GET", "/json", b"", b'{"n":2}', id="json"),
        pytest.param("POST", "/json", b"x" * 100_000, b'{"n":2}', id="json-with-a-body"),
        pytest.param(
            "GET", "/stream", b"", b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n', id="sse"
        ),
    ],
)
def test_starlettes_test_client_gets_the_answer_and_nothing_is_aborted(
    method: str, path: str, body: bytes, expected: bytes
) -> None:
    engine = Engine()  # (its script: two outputs, the last one finishes)
    with TestClient(make_app(engine)) as client:
        for _ in range(3):
            response = client.request(method, path, content=body)
            assert (response.status_code, response.content) == (200, expected)
    assert engine.aborted == []
    assert engine.registry.in_flight == 0
