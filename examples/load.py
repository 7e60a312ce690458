"""The demo's HTTP load: clients that check every token they receive.

Each client sends ``POST /generate`` requests of four kinds (one prompt or a
batch, streamed or not), some of which it abandons part-way, and checks every
output against the engine's deterministic tokens: a token lost, repeated or out
of order is recorded as an error. Requests carry client-chosen ids (``rid``) so
that the time of each disconnect can be matched with the time the server's
engine was told to abort (``GET /metrics/aborts``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any

import httpx
from engine import token_at

__all__ = ["KINDS", "Client", "KindTally", "Tally"]

KINDS = ("single stream", "single json", "batch stream", "batch json")


@dataclasses.dataclass(slots=True)
class KindTally:
    """What happened to the requests of one kind."""

    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    outputs: int = 0
    verified: int = 0
    first_output: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Tally:
    """Everything the clients of one run saw."""

    kinds: dict[str, KindTally] = dataclasses.field(
        default_factory=lambda: {kind: KindTally() for kind in KINDS}
    )
    errors: list[str] = dataclasses.field(default_factory=list)
    disconnects: dict[str, float] = dataclasses.field(default_factory=dict)
    sub_requests: int = 0

    def total(self, field: str) -> int:
        """The sum of one counter over every kind."""
        return sum(getattr(kind, field) for kind in self.kinds.values())


class _Check:
    """Checks one request's outputs, in order, against the engine's tokens."""

    def __init__(self, prompts: list[str], max_tokens: int, tally: KindTally, errors: list[str]):
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.tally = tally
        self.errors = errors
        self.seen = [0] * len(prompts)
        self.finish: list[str | None] = [None] * len(prompts)

    def output(self, index: int, out: dict[str, Any]) -> None:
        meta = out["meta_info"]
        before, after = self.seen[index], meta["completion_tokens"]
        prompt = self.prompts[index]
        expected = "".join(token_at(prompt, position) for position in range(before, after))
        self.tally.outputs += max(0, after - before)
        if after <= before or out["text"] != expected:
            self.errors.append(
                f"{meta['id']}: tokens {before}..{after} lost or out of order: {out['text']!r}"
            )
            return
        self.tally.verified += after - before
        self.seen[index] = after
        self.finish[index] = meta["finish_reason"]

    def complete(self, rid: str) -> None:
        for index, seen in enumerate(self.seen):
            if seen != self.max_tokens or self.finish[index] != "length":
                self.errors.append(f"{rid}[{index}]: ended after {seen}/{self.max_tokens} tokens")


class Client:
    """One load client: sends requests one after the other until told to stop.

    :param client: the HTTP client (shared by every load client of a run).
    :param tally: where to record what happened.
    :param name: prefix of this client's request ids.
    :param seed: seeds this client's choices.
    :param disconnect_share: the share of requests abandoned part-way.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        tally: Tally,
        name: str,
        *,
        seed: int,
        disconnect_share: float = 0.25,
    ) -> None:
        self.client = client
        self.tally = tally
        self.name = name
        self.random = random.Random(seed)
        self.disconnect_share = disconnect_share
        self.sent = 0

    async def run(self, deadline: float) -> None:
        """Send requests until ``time.monotonic()`` passes ``deadline``."""
        while time.monotonic() < deadline:
            await self.one()

    async def one(self) -> None:
        """Send one request of a random kind and check what comes back."""
        rng = self.random
        self.sent += 1
        batched = rng.random() < 0.4
        stream = rng.random() < 0.6
        leave = rng.random() < self.disconnect_share
        size = rng.randint(2, 4) if batched else 1
        rid = f"{self.name}-{self.sent}"
        rids = [f"{rid}-{i}" for i in range(size)] if batched else [rid]
        prompts = [f"{self.name} prompt {self.sent}.{i}" for i in range(size)]
        max_tokens = 400 if leave else rng.randint(8, 48)
        kind = f"{'batch' if batched else 'single'} {'stream' if stream else 'json'}"
        tally = self.tally.kinds[kind]
        tally.requests += 1
        self.tally.sub_requests += size
        body = {
            "text": prompts if batched else prompts[0],
            "rid": rids if batched else rid,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        check = _Check(prompts, max_tokens, tally, self.tally.errors)
        if stream:
            events = rng.randint(1, 20) if leave else None
            await self._stream(body, rids, check, events)
        else:
            delay = rng.uniform(0.05, 0.25) if leave else None
            await self._json(body, rids, check, delay)

    async def _stream(
        self, body: dict[str, Any], rids: list[str], check: _Check, leave_after: int | None
    ) -> None:
        sent = time.monotonic()
        events = 0
        async with self.client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self.tally.errors.append(f"{rids[0]}: status {response.status_code}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    check.tally.completed += 1
                    check.complete(rids[0])
                    return
                out = json.loads(data)
                if "error" in out:
                    self.tally.errors.append(f"{rids[0]}: error event {out['error']}")
                    return
                if events == 0:
                    check.tally.first_output.append(time.monotonic() - sent)
                check.output(out.get("index", 0), out.get("output", out))  # (a batch: an envelope)
                events += 1
                if events == leave_after:
                    # Leaving the block closes the connection mid-stream.
                    now = time.monotonic()
                    self.tally.disconnects.update(dict.fromkeys(rids, now))
                    check.tally.disconnected += 1
                    return
        self.tally.errors.append(f"{rids[0]}: stream ended without [DONE]")

    async def _json(
        self, body: dict[str, Any], rids: list[str], check: _Check, leave_after: float | None
    ) -> None:
        sent = time.monotonic()
        deadline = None if leave_after is None else sent + leave_after
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.client.post("/generate", json=body)
        except TimeoutError:
            # The cancelled request closes its connection; the deadline is the
            # earliest moment it can have happened, so latencies are not flattered.
            assert deadline is not None
            self.tally.disconnects.update(dict.fromkeys(rids, deadline))
            check.tally.disconnected += 1
            return
        if response.status_code != 200:
            self.tally.errors.append(f"{rids[0]}: status {response.status_code}")
            return
        check.tally.first_output.append(time.monotonic() - sent)
        result = response.json()
        for index, out in enumerate(result if isinstance(result, list) else [result]):
            check.output(index, out)
        check.tally.completed += 1
        check.complete(rids[0])
