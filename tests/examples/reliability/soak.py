"""The soak's clients: many concurrent requests of every kind, each checked to the token.

A round sends ``requests`` requests from ``concurrency`` clients at once. Each
request is one prompt or a batch, streamed or not, and one of three kinds:

* **normal**: must complete with every token in order (or fail with the engine's
  500 when the engine fails one of its sub-requests on purpose);
* **leaver** (a quarter): the client disconnects at a random point: after a random
  number of events, or a random delay for a JSON answer. Most leavers ask for far
  more tokens than the round lasts, so only an abort can end them;
* **deadline**: ``timeout`` far shorter than the generation: must end with 504
  (a status, or an error event once the stream started).

Whatever the client saw is checked against the server's :class:`~harness.Ledger`
afterwards (:func:`reconcile`): a completed request finished, a left or expired
one was aborted (exactly once), a failed one was failed by the engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
from typing import Any, Final

import aiohttp
from engine import token_at

from .harness import BOUND, Ledger

LONG: Final = 4000
"""Tokens asked by requests that only an abort or a deadline can end (8 s at least)."""


@dataclasses.dataclass(slots=True)
class Plan:
    """One request: what to send and how the client behaves."""

    rid: str
    prompts: list[str]
    batched: bool
    stream: bool
    max_tokens: int
    leave_after_events: int | None = None
    leave_after_seconds: float | None = None
    timeout: float | None = None

    @property
    def rids(self) -> list[str]:
        return [f"{self.rid}.{i}" for i in range(len(self.prompts))] if self.batched else [self.rid]

    @property
    def leaves(self) -> bool:
        return self.leave_after_events is not None or self.leave_after_seconds is not None

    def body(self) -> dict[str, Any]:
        return {
            "text": self.prompts if self.batched else self.prompts[0],
            "rid": self.rids if self.batched else self.rid,
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "timeout": self.timeout,
        }


def plan(rng: random.Random, rid: str, *, leave_share: float, deadline_share: float) -> Plan:
    """A random request; ``rid`` must be unique in the round."""
    batched = rng.random() < 0.4
    size = rng.randint(2, 4) if batched else 1
    prompts = [f"{rid} prompt {i}" for i in range(size)]
    stream = rng.random() < 0.6
    draw = rng.random()
    request = Plan(rid, prompts, batched, stream, rng.randint(4, 24))
    if draw < leave_share:
        # Two leavers in three cannot finish before they leave; one in three may.
        if rng.random() < 2 / 3:
            request.max_tokens = LONG
        if stream:
            request.leave_after_events = rng.randint(0, min(20, request.max_tokens - 1))
        else:
            request.leave_after_seconds = rng.uniform(0.0, 0.3)
    elif draw < leave_share + deadline_share:
        request.max_tokens = LONG
        request.timeout = rng.uniform(0.02, 0.3)
    return request


@dataclasses.dataclass
class Figures:
    """What one round's clients saw."""

    requests: int = 0
    sub_requests: int = 0
    completed: int = 0
    disconnected: int = 0
    deadlines: int = 0
    engine_failures: int = 0
    tokens: int = 0
    statuses: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    outcomes: dict[str, tuple[Plan, str]] = dataclasses.field(default_factory=dict)

    def add(self, other: Figures) -> None:
        """Add ``other``'s counts to these (the outcomes are per round: not kept)."""
        counts = ("requests", "sub_requests", "completed", "disconnected", "deadlines")
        for name in (*counts, "engine_failures", "tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.statuses.update(other.statuses)
        self.errors.extend(other.errors)


class _Tokens:
    """Checks one request's outputs, in order, against the engine's tokens."""

    def __init__(self, request: Plan, figures: Figures) -> None:
        self.request = request
        self.figures = figures
        self.seen = [0] * len(request.prompts)
        self.last_reason: list[str | None] = [None] * len(request.prompts)

    def output(self, index: int, out: dict[str, Any]) -> None:
        meta = out["meta_info"]
        before, after = self.seen[index], meta["completion_tokens"]
        prompt = self.request.prompts[index]
        expected = "".join(token_at(prompt, position) for position in range(before, after))
        if after <= before or out["text"] != expected:
            raise AssertionError(f"{meta['id']}: tokens {before}..{after} lost or out of order")
        self.figures.tokens += after - before
        self.seen[index] = after
        self.last_reason[index] = meta["finish_reason"]

    def complete(self) -> None:
        want = self.request.max_tokens
        for index, seen in enumerate(self.seen):
            if seen != want or self.last_reason[index] != "length":
                raise AssertionError(f"{self.request.rid}[{index}]: ended at {seen}/{want} tokens")


async def one(session: aiohttp.ClientSession, request: Plan, figures: Figures) -> None:
    """Send ``request``, behave as planned, check what came back; the outcome is
    recorded in ``figures.outcomes`` for :func:`reconcile`."""
    figures.requests += 1
    figures.sub_requests += len(request.prompts)
    try:
        outcome = await _send(session, request, figures)
    except AssertionError as exc:
        figures.errors.append(str(exc))
        outcome = "wrong"
    except (aiohttp.ClientError, TimeoutError) as exc:
        figures.errors.append(f"{request.rid}: {type(exc).__name__}: {exc}")
        outcome = "broken"
    figures.outcomes[request.rid] = (request, outcome)
    if outcome == "completed":
        figures.completed += 1
    elif outcome == "left":
        figures.disconnected += 1
    elif outcome == "expired":
        figures.deadlines += 1
    elif outcome == "failed":
        figures.engine_failures += 1


async def _send(session: aiohttp.ClientSession, request: Plan, figures: Figures) -> str:
    tokens = _Tokens(request, figures)
    try:
        async with asyncio.timeout(request.leave_after_seconds):
            async with session.post("/generate", json=request.body()) as response:
                figures.statuses[response.status] += 1
                if response.status != 200:
                    return _refused(request, response.status, await response.json())
                if not request.stream:
                    result = await response.json()
                    for index, out in enumerate(result if request.batched else [result]):
                        tokens.output(index, out)
                    tokens.complete()
                    return "completed"
                return await _read_stream(request, response, tokens)
    except TimeoutError:
        if request.leave_after_seconds is None:
            raise
        return "left"


async def _read_stream(request: Plan, response: aiohttp.ClientResponse, tokens: _Tokens) -> str:
    events = 0
    if request.leave_after_events == 0:
        response.close()
        return "left"
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            tokens.complete()
            return "completed"
        out = json.loads(data)
        if "error" in out:
            await response.read()
            return _refused(request, out["error"]["code"], out)
        tokens.output(out.get("index", 0), out.get("output", out))  # (a batch: an envelope)
        events += 1
        if events == request.leave_after_events:
            response.close()  # mid-stream: the connection goes with it
            return "left"
    raise AssertionError(f"{request.rid}: the stream ended without [DONE]")


def _refused(request: Plan, status: int, body: Any) -> str:
    code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    if code != status:
        raise AssertionError(f"{request.rid}: status {status} with body {body!r}")
    if status == 504 and request.timeout is not None:
        return "expired"
    if status == 500 and body["error"]["type"] == "ProducerError":
        return "failed"
    raise AssertionError(f"{request.rid}: unexpected status {status}: {body!r}")


async def round_of(
    url: str,
    requests: int,
    *,
    concurrency: int,
    seed: int,
    leave_share: float = 0.25,
    deadline_share: float = 0.1,
) -> Figures:
    """Send ``requests`` requests from ``concurrency`` concurrent clients; every
    request is bounded, so a hang fails the round instead of stalling it."""
    figures = Figures()
    plans = collections.deque(
        plan(
            random.Random(seed * 1_000_003 + n),
            f"r{seed}-{n}",
            leave_share=leave_share,
            deadline_share=deadline_share,
        )
        for n in range(requests)
    )
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=3 * BOUND)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:

        async def client() -> None:
            while plans:
                await one(session, plans.popleft(), figures)

        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(client())
    return figures


def reconcile(figures: Figures, ledger: Ledger) -> list[str]:
    """What the clients saw against the server's books; one line per disagreement."""
    found = []
    for rid, (request, outcome) in figures.outcomes.items():
        rids = request.rids
        opened = [r for r in rids if r in ledger.opened]
        if outcome == "completed":
            ok = all(r in ledger.finished for r in rids)
        elif outcome == "expired":
            ok = len(opened) == len(rids) and all(ledger.aborts[r] == 1 for r in rids)
        elif outcome == "failed":
            ok = any(r in ledger.failed for r in rids)
        elif outcome == "left" and request.max_tokens == LONG:
            # it could not have finished: the server must have noticed the client leave
            ok = all(ledger.aborts[r] == 1 or r in ledger.failed for r in opened)
        else:
            ok = outcome == "left"  # may have finished first; the ledger checks the rest
        if not ok:
            found.append(
                f"{rid}: client saw {outcome!r}; server: opened={opened} "
                f"finished={[r for r in rids if r in ledger.finished]} "
                f"failed={[r for r in rids if r in ledger.failed]}"
            )
    return found
