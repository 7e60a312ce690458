"""The resumption scene of ``make demo``: streaming clients of which a quarter drop
mid-stream and resume, and every token must arrive exactly once.

Each client sends resumable ``POST /generate`` streams (``"resume": true``) one after
the other; a quarter of them it drops after a few events (leaving the response
closes the connection, as a network drop or a page refresh does) and sends again
with the ``Last-Event-ID`` it saw. The text of both halves together must be the
engine's whole answer, once and in order, and the server must have aborted nothing:
a dropped client only parked its request. Resume latency is from the reconnect to
the first replayed event, as the client sees it.

Two settings: each server alone (its streams kept in process), then, when a
``redis-server`` is on PATH, both servers sharing one Redis, every drop resumed on
the *other* server (``--redis``: a load balancer sends the reconnect anywhere).

    python examples/resumescene.py [--seconds 3] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from engine import expected_text
from launch import launched, redis_server

__all__ = ["DROP_SHARE", "SceneTally", "run"]

DROP_SHARE = 0.25
"""The share of streams a client drops mid-stream and resumes."""


@dataclasses.dataclass(slots=True)
class SceneTally:
    """What the clients of one setting saw."""

    streams: int = 0
    resumed: int = 0
    tokens: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """The ``(id, data)`` of each SSE event of ``response`` (comments skipped)."""
    event_id: str | None = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            yield event_id, line[6:]
            event_id = None


class _Stream:
    """One resumable generation as its client reads it, over one or two connections."""

    def __init__(self, prompt: str, max_tokens: int) -> None:
        self.body = {"text": prompt, "max_tokens": max_tokens, "stream": True, "resume": True}
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.text: list[str] = []
        self.last_id: str | None = None
        self.done = False
        self.failed = False

    async def read(
        self,
        client: httpx.AsyncClient,
        tally: SceneTally,
        *,
        headers: dict[str, str] | None = None,
        leave_after: int | None = None,
    ) -> float | None:
        """Read one connection's events; returns when the first one came (or ``None``).

        :param leave_after: drop the connection after this many events.
        """
        first: float | None = None
        events = 0
        async with client.stream("POST", "/generate", json=self.body, headers=headers) as answer:
            if answer.status_code != 200:
                await answer.aread()
                tally.errors.append(f"{self.prompt}: status {answer.status_code}")
                self.failed = True
                return None
            async for event_id, data in _events(answer):
                first = time.monotonic() if first is None else first
                if data == "[DONE]":
                    self.done = True
                    return first
                output = json.loads(data)
                if "error" in output:
                    tally.errors.append(f"{self.prompt}: error event {output['error']}")
                    self.failed = True
                    return first
                self.text.append(output["text"])
                self.last_id = event_id
                events += 1
                if events == leave_after:
                    return first  # leaving the block closes the connection mid-stream
        return first

    def check(self, tally: SceneTally) -> None:
        """Every token once and in order, and the end seen."""
        whole = expected_text(self.prompt, self.max_tokens)
        if self.failed:
            return
        if not self.done or "".join(self.text) != whole:
            tally.errors.append(f"{self.prompt}: tokens lost, repeated or out of order")
        else:
            tally.tokens += self.max_tokens


async def _client(
    clients: Sequence[httpx.AsyncClient], tally: SceneTally, index: int, deadline: float
) -> None:
    """Streams one after the other until ``deadline``; a drop resumes on the next server."""
    rng = random.Random(index)
    here, there = clients[index % len(clients)], clients[(index + 1) % len(clients)]
    sent = 0
    while time.monotonic() < deadline:
        sent += 1
        stream = _Stream(f"resumable c{index} #{sent}", rng.randint(40, 120))
        tally.streams += 1
        drop = rng.randint(1, 20) if rng.random() < DROP_SHARE else None
        await stream.read(here, tally, leave_after=drop)
        if not (stream.done or stream.failed) and stream.last_id is not None:
            tally.resumed += 1
            reconnected = time.monotonic()
            first = await stream.read(there, tally, headers={"Last-Event-ID": stream.last_id})
            if first is not None:
                tally.latencies.append(first - reconnected)
        stream.check(tally)


async def _books(url: str) -> dict[str, Any]:
    """A server's ``/stats`` once nothing is in flight (bounded: 10 s)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with asyncio.timeout(10):
            while True:
                stats: dict[str, Any] = (await client.get("/stats")).json()
                if stats["in_flight"] == 0:
                    return stats
                await asyncio.sleep(0.05)


async def scene(label: str, urls: Sequence[str], *, seconds: float, clients: int) -> bool:
    """Drive the servers at ``urls`` and print one line; returns whether all was well."""
    tally = SceneTally()
    async with contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            for url in urls
        ]
        deadline = time.monotonic() + seconds
        async with asyncio.TaskGroup() as group:
            for index in range(clients):
                group.create_task(_client(sessions, tally, index, deadline))
    books = [await _books(url) for url in urls]
    aborted = {reason: n for stats in books for reason, n in stats["aborted"].items()}
    finished = sum(stats["finished"] for stats in books)
    if aborted:
        tally.errors.append(f"requests aborted although every client resumed: {aborted}")
    if finished != tally.streams:
        tally.errors.append(f"{finished} streams finished of {tally.streams}")
    ordered = sorted(tally.latencies)
    p50 = ordered[len(ordered) // 2] * 1000 if ordered else math.nan
    print(
        f"  {label:<30}{tally.streams:>8}{tally.resumed:>9}{tally.tokens:>9}"
        f"{p50:>12.1f} ms   {'FAILED' if tally.errors else 'OK'}"
    )
    for error in tally.errors[:5]:
        print(f"    FAIL: {error}")
    return not tally.errors


async def run(servers: Sequence[str], *, seconds: float, clients: int) -> bool:
    """The scene: each server alone, then (with ``redis-server``) two sharing Redis."""
    print(f"Resumable streams: {DROP_SHARE:.0%} of the streams dropped mid-stream and resumed")
    print(f"  {'where':<30}{'streams':>8}{'resumed':>9}{'tokens':>9}{'resume p50':>15}")
    clean = True
    for name in servers:
        async with launched(name) as url:
            clean = await scene(f"{name} alone", [url], seconds=seconds, clients=clients) and clean
    if len(servers) >= 2 and shutil.which("redis-server") is None:
        print("  (two servers sharing Redis: skipped, no redis-server on PATH)")
    elif len(servers) >= 2:
        async with redis_server() as redis:
            options = ["--redis", redis]
            async with launched(servers[0], options) as a, launched(servers[1], options) as b:
                label = f"{servers[0]} <-> {servers[1]} (Redis)"
                clean = await scene(label, [a, b], seconds=seconds, clients=clients) and clean
    print()
    return clean


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scene alone; returns the exit status (0 when every check passed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="load time per setting")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    args = parser.parse_args(argv)
    servers = ["starlette", "aiohttp", "fastapi"]
    clean = asyncio.run(run(servers, seconds=args.seconds, clients=args.clients))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
