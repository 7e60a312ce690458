"""The example servers offer resumption on ``/generate`` (``"resume": true``): a client
that drops mid-stream reconnects with ``Last-Event-ID`` and the text it puts together
is the whole answer, once; the books balance (nothing aborted, nothing left)."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:  # the examples import their siblings as top-level modules
    sys.path.insert(0, str(EXAMPLES))

from engine import expected_text  # noqa: E402

from tests.e2e.harness import SERVERS, running, service  # noqa: E402

from .conftest import Reader, client  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _text(events: list[Any]) -> str:
    return "".join(event["text"] for event in events if isinstance(event, dict))


@pytest.mark.parametrize("name", SERVERS)
async def test_a_dropped_generation_resumes_and_the_text_is_whole_once(name: str) -> None:
    prompt, tokens = "resume me", 300
    body = {"text": prompt, "max_tokens": tokens, "stream": True, "resume": True}
    async with running(name, service(step_interval=0.005)) as server, client() as session:
        response = await session.post(f"{server.url}/generate", json=body)
        assert response.status == 200
        first = Reader(response)
        seen = await first.take(5)
        first.close()
        again = await session.post(
            f"{server.url}/generate", headers={"Last-Event-ID": str(first.last_id)}
        )
        assert again.status == 200
        seen += await Reader(again).rest()
        assert seen[-1] == "[DONE]"
        assert _text(seen) == expected_text(prompt, tokens)
        await server.idle()
        assert server.ledger.problems() == []
        assert not server.ledger.aborts


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "stream": False, "resume": True},
        {"text": ["x", "y"], "stream": True, "resume": True},
        {"text": "x", "stream": True, "resume": "yes"},
    ],
    ids=["not-streamed", "batch", "not-a-flag"],
)
async def test_resume_is_refused_where_it_cannot_apply(body: dict[str, Any]) -> None:
    async with running("starlette", service()) as server, client() as session:
        response = await session.post(f"{server.url}/generate", data=json.dumps(body))
        assert response.status == 422
        assert server.ledger.in_flight == 0
