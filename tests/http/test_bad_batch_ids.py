"""A client's bad batch of ids is the client's error, on both adapters.

The ids of a batch come from the client exactly as a single id does: a batch that
names the same id twice, or names none, gets a 4xx with a JSON body (never a
text/plain 500 and a logged traceback), and nothing stays in flight.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import httpx
import pytest

import tether
from tests._support.servers import ADAPTERS, serving

BAD_BATCHES = [
    pytest.param(["x", "x"], id="the-same-id-twice"),
    pytest.param([], id="no-id"),
]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("rids", BAD_BATCHES)
async def test_a_bad_batch_of_client_ids_gets_a_4xx_json_error(
    adapter: str, rids: list[str]
) -> None:
    registry = tether.Registry()

    async def endpoint(verbs: ModuleType, request: Any) -> Any:
        batch = verbs.get_registry(request).open_batch((await request.json())["rids"])
        for rid in batch.rids:
            registry.deliver(rid, rid, finished=True)
        return await verbs.respond(request, batch, streaming=False)

    async with (
        serving(adapter, registry, "POST", "/batch", endpoint) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        response = await client.post(f"{url}/batch", json={"rids": rids})
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert "error" in response.json()
    assert registry.in_flight == 0
