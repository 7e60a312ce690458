"""``respond(streaming=False)`` on both adapters, real servers: a result of megabytes
of non-ASCII text arrives whole and exact; a result with a lone surrogate (that no
UTF-8 body can carry) is a 500 and its work aborted once, as the server's fault; the
extra headers of ``respond()`` win over tether's; a transform that raises is a 500;
a batch answers its results in order; and in every case the request ends, freed.
"""

from __future__ import annotations

import asyncio
import collections
import json
from types import ModuleType
from typing import Any, Final

import aiohttp
import pytest

import tether
from tests._support.servers import ADAPTERS, serving
from tests._support.waiting import eventually

pytestmark = pytest.mark.parametrize("name", ADAPTERS)

BIG: Final = "é漢🙂" * 400_000  # about 3.6 MB of UTF-8


def _answer(**options: Any) -> Any:
    async def answer(verbs: ModuleType, request: Any) -> Any:
        body = await request.json()
        registry = verbs.get_registry(request)
        results = body["results"]
        source = registry.open_batch(len(results)) if body.get("batch") else registry.open()
        rids = source.rids if isinstance(source, tether.Batch) else (source.rid,)
        outputs = results if body.get("batch") else [results[0]]
        if body.get("big"):  # (made here: a request body this big is refused, 413)
            outputs = [{"text": BIG}]
        if body.get("surrogate"):
            outputs = [{"text": "\ud800"}]
        for rid, output in zip(rids, outputs, strict=True):
            registry.deliver(rid, output, finished=True)
        return await verbs.respond(request, source, streaming=False, **options)

    return answer


async def _post(
    name: str, registry: tether.Registry, body: dict[str, Any], **options: Any
) -> tuple[int, dict[str, str], bytes]:
    async with (
        serving(name, registry, "POST", "/answer", _answer(**options)) as url,
        aiohttp.ClientSession(url) as http,
    ):
        async with asyncio.timeout(30), http.post("/answer", json=body) as response:
            headers = {key.lower(): value for key, value in response.headers.items()}
            answer = (response.status, headers, await response.read())
        await eventually(lambda: registry.in_flight == 0)
    return answer


async def test_megabytes_of_non_ascii_arrive_whole_and_exact(name: str) -> None:
    registry = tether.Registry()
    status, headers, body = await _post(name, registry, {"results": [{}], "big": True})
    assert status == 200
    assert headers["content-length"] == str(len(body))
    assert json.loads(body) == {"text": BIG}


async def test_a_lone_surrogate_is_a_500_and_the_work_aborted_once(name: str) -> None:
    aborts: collections.Counter[str] = collections.Counter()
    registry = tether.Registry(lambda rid: aborts.update([rid]))
    status, _, body = await _post(name, registry, {"results": [{}], "surrogate": True})
    assert status == 500, body
    assert json.loads(body)["error"]
    assert all(count == 1 for count in aborts.values()), aborts


async def test_respond_headers_win_over_tethers_on_a_json_answer(name: str) -> None:
    registry = tether.Registry()
    status, headers, body = await _post(
        name,
        registry,
        {"results": [{"n": 1}]},
        headers={"Content-Type": "application/vnd.test+json", "X-Extra": "1"},
    )
    assert (status, json.loads(body)) == (200, {"n": 1})
    assert headers["content-type"].startswith("application/vnd.test+json")
    assert headers["x-extra"] == "1"


async def test_a_transform_that_raises_is_a_500_and_frees_the_request(name: str) -> None:
    def transform(result: Any) -> Any:
        raise ValueError("the app's transform failed")

    registry = tether.Registry()
    status, _, body = await _post(name, registry, {"results": [{"n": 1}]}, transform=transform)
    assert status == 500, body


async def test_a_batch_answers_its_results_in_order(name: str) -> None:
    registry = tether.Registry()
    results = [{"i": index, "t": "ü" * index} for index in range(50)]
    status, _, body = await _post(name, registry, {"results": results, "batch": True})
    assert (status, json.loads(body)) == (200, results)
