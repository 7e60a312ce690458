"""With the default byte budget, a lagging consumer costs the producer no more than
its outputs.

With ``merge``, weighing the *merged* output on every ``deliver`` while a backlog
waits would make one ``deliver`` cost as much as the backlog, and a lag quadratic:
outputs that carry a growing list (token ids, as SGLang and vLLM outputs do) merged
in place would cost milliseconds per ``deliver`` after a few thousand tokens, on
the producer's own loop, so one client reading slowly would stall every request
(measured once: 5,000 lagging tokens took 20 s, 1 ms without the budget).
"""

from __future__ import annotations

import time
from typing import Any

import tether

TOKENS = 8000
BOUND = 2.0  # seconds; about 5 ms without the byte budget on this kind of machine


def merge(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    older["token_ids"].extend(newer["token_ids"])  # in place: the merge itself is O(1)
    older["text"] += newer["text"]
    return older


async def test_delivering_to_a_lagging_consumer_costs_the_producer_no_more_than_its_outputs() -> (
    None
):
    registry = tether.Registry(merge=merge)  # the default byte budget
    stream = registry.open()
    started = time.perf_counter()
    delivered = 0
    for token in range(TOKENS):  # the consumer reads nothing meanwhile
        registry.deliver(stream.rid, {"token_ids": [token], "text": " tok"})
        delivered += 1
        if time.perf_counter() - started > BOUND:
            break
    elapsed = time.perf_counter() - started
    await stream.aclose()
    assert delivered == TOKENS, f"only {delivered} of {TOKENS} deliveries in {elapsed:.1f}s"
