"""The example engine's door (``examples/engine_server.py`` in its own process, as
users start it): a submission it cannot run fails alone, with 422, and the next one
is served."""

from __future__ import annotations

import asyncio

import pytest

import tether
import tether.http
from tether_zmq import RemoteFailure

from .conftest import example_engine
from .linked import front

pytestmark = pytest.mark.timeout(60)


BAD_SUBMISSIONS = {
    "infinite max_tokens": {"prompt": "hi", "max_tokens": float("inf")},
    "NaN max_tokens": {"prompt": "hi", "max_tokens": float("nan")},
    "huge max_tokens": {"prompt": "hi", "max_tokens": 2**63},
    "boolean max_tokens": {"prompt": "hi", "max_tokens": True},
    "text max_tokens": {"prompt": "hi", "max_tokens": "3"},
    "zero max_tokens": {"prompt": "hi", "max_tokens": 0},
    "list prompt": {"prompt": ["hi"], "max_tokens": 3},
    "no prompt": {"max_tokens": 3},
    "not a map": ["hi", 3],
}


@pytest.mark.parametrize("request_", BAD_SUBMISSIONS.values(), ids=BAD_SUBMISSIONS.keys())
async def test_the_example_engine_fails_a_bad_submission_alone_and_serves_the_next(
    request_: object, ipc_dir: str
) -> None:
    async with (
        example_engine(f"ipc://{ipc_dir}/engine") as engine,
        front(engine.address) as client,
    ):
        bad = client.open(request_)
        async with asyncio.timeout(10):
            with pytest.raises(tether.ProducerError) as caught:
                await bad.result()
        assert isinstance(caught.value.__cause__, RemoteFailure)
        refusal = tether.http.error_response(caught.value)
        assert refusal.status == 422
        assert "max_tokens" in refusal.body["error"]["message"] or "prompt" in str(refusal.body)
        async with asyncio.timeout(10):
            outputs = [output async for output in client.open({"prompt": "hi", "max_tokens": 3})]
        assert [o["meta_info"]["completion_tokens"] for o in outputs] == [1, 2, 3]
        assert client.stats().links_lost == 0
        assert client.registry.in_flight == 0
        assert (await engine.report())["link"]["in_flight"] == 0
