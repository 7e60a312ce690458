"""Resumable streams' benchmark: how fast a reconnect is answered, and what resumption
costs per event.

Two measurements, in one run:

* **resume latency**: from a reconnect (a new TCP connection sending ``POST /generate``
  with ``Last-Event-ID``, 30 ms after the drop, so that events wait to be replayed) to
  the first replayed event, as the client reads it; p50 and p90 over ``--probes``
  drops. In process: one example server (Starlette on uvicorn) holds the stream.
  Through Redis: two example servers (Starlette on uvicorn, aiohttp) share a
  ``redis-server``; the stream starts on one and the reconnect goes to the other.
  The servers are subprocesses on 127.0.0.1; the client speaks raw HTTP/1.1 on an
  asyncio socket, so that its own cost stays out.
* **cost per event**: ``--streams`` streams of ``--outputs`` outputs each, delivered one
  output per live stream per loop step, each stream read through a
  ``tether.http.Exchange`` into SSE bytes (the HTTP write path minus the socket):
  resumption off (the same-run baseline), on with the in-process store, and on with
  ``RedisStore`` (every event also written to Redis). Wall time per event, median of
  ``--rounds`` interleaved rounds, and the ratio to the baseline.

Then the section between ``<!-- resume:begin -->`` and ``<!-- resume:end -->`` of
``bench/RESULTS.md`` is rewritten. Run it with ``make bench`` or
``python -m bench.resume`` (``--no-readme`` to leave it alone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from tether_redis import RedisStore

import tether
import tether.resume
from tether.http import Exchange

from .report import rewrite_readme
from .stats import percentile

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
BEGIN, END = "<!-- resume:begin -->", "<!-- resume:end -->"
sys.path.insert(0, str(ROOT / "examples"))  # the example servers' launcher

from launch import launched, redis_server  # noqa: E402

# -- resume latency over HTTP ---------------------------------------------------------


async def _post(port: int, headers: dict[str, str]) -> tuple[asyncio.StreamReader, Any]:
    """Send one ``POST /generate`` (a long resumable stream) on a new connection."""
    body = json.dumps({"text": "bench", "max_tokens": 4000, "stream": True, "resume": True})
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n{body}"
        ).encode()
    )
    return reader, writer


async def _next_id(reader: asyncio.StreamReader) -> str:
    """Read up to the next event's id (chunk-size lines and headers pass by)."""
    while line := await reader.readline():
        if line.startswith(b"id: "):
            return line[4:].strip().decode()
    raise ConnectionError("the stream ended")


async def _probe(owner: int, other: int) -> float:
    """Drop a stream after 3 events on ``owner``; resume it on ``other``; seconds from
    the reconnect to its first replayed event. Then Stop it (the engine's slot)."""
    reader, writer = await _post(owner, {})
    for _ in range(3):
        last = await _next_id(reader)
    writer.transport.abort()  # a drop: no goodbye
    await asyncio.sleep(0.03)  # (a few engine steps: events to replay, not the live tail)
    started = time.perf_counter()
    reader, writer = await _post(other, {"Last-Event-ID": last})
    await _next_id(reader)
    elapsed = time.perf_counter() - started
    writer.transport.abort()
    token = last.rpartition(".")[0]
    stop, closer = await asyncio.open_connection("127.0.0.1", owner)
    closer.write(
        f"POST /generate/stop HTTP/1.1\r\nHost: 127.0.0.1\r\nTether-Resume-Token: {token}\r\n"
        f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
    )
    await stop.read()
    closer.close()
    return elapsed


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def resume_latency(probes: int) -> dict[str, list[float]]:
    """Resume latencies in process and through Redis (seconds)."""
    found: dict[str, list[float]] = {"memory": [], "redis": []}
    async with launched("starlette") as url:
        port = _port(url)
        for _ in range(probes):
            found["memory"].append(await _probe(port, port))
    async with redis_server() as redis:
        options = ["--redis", redis]
        async with launched("starlette", options) as a, launched("aiohttp", options) as b:
            for n in range(probes):
                owner, other = (_port(a), _port(b)) if n % 2 else (_port(b), _port(a))
                found["redis"].append(await _probe(owner, other))
    return found


# -- cost per event ---------------------------------------------------------------------


async def _read(exchange: Exchange) -> int:
    """Everything an exchange writes, as an adapter's loop would move it; bytes."""
    size = len((await exchange.start()).body)
    try:
        while not exchange.done:
            size += len(await exchange.next_chunk())
    finally:
        await exchange.aclose()
    return size


async def _events(streams: int, outputs: int, resume: tether.resume.Resume | None) -> float:
    """Seconds to deliver and frame ``streams`` x ``outputs`` outputs (and, with
    ``resume``, to record them and close its store)."""
    registry = tether.Registry()
    started = time.perf_counter()
    opened = [registry.open() for _ in range(streams)]
    sources: list[Any] = opened
    if resume is not None:
        sources = [await resume.open(stream) for stream in opened]
    readers = [asyncio.create_task(_read(Exchange(s, streaming=True))) for s in sources]
    meta: dict[str, Any] = {"finish_reason": None}
    for step in range(outputs):
        last = step == outputs - 1
        for stream in opened:
            registry.deliver(stream.rid, {"text": " word", "meta_info": meta}, finished=last)
        await asyncio.sleep(0)  # the producer yields to the loop after each step
    await asyncio.gather(*readers)
    if resume is not None:
        await resume.aclose()
    elapsed = time.perf_counter() - started
    await registry.close(drain_timeout=0)
    return elapsed


async def event_cost(streams: int, outputs: int, rounds: int, redis: str) -> dict[str, list[float]]:
    """Microseconds per event: resumption off, on in process, on through Redis."""
    client = Redis.from_url(redis)
    setups: dict[str, Callable[[], tether.resume.Resume | None]] = {
        "off": lambda: None,
        "memory": lambda: tether.resume.Resume(max_events=outputs + 1),
        "redis": lambda: tether.resume.Resume(max_events=outputs + 1, store=RedisStore(client)),
    }
    found: dict[str, list[float]] = {name: [] for name in setups}
    try:
        for _ in range(rounds):
            for name, setup in setups.items():  # interleaved: load drifts hit each alike
                seconds = await _events(streams, outputs, setup())
                found[name].append(seconds / (streams * outputs) * 1e6)
            await client.flushall()
    finally:
        await client.aclose()
    return found


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    latency = await resume_latency(args.probes)
    async with redis_server() as redis:
        cost = await event_cost(args.streams, args.outputs, args.rounds, redis)
    return {"latency": latency, "cost": cost}


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    latency, cost = results["latency"], results["cost"]
    verdict = {True: "met", False: "**not met**"}

    def ms(samples: list[float], q: float) -> float:
        found = percentile(samples, q)
        return math.nan if found is None else found * 1e3

    memory_p50, redis_p50 = ms(latency["memory"], 50), ms(latency["redis"], 50)
    off = statistics.median(cost["off"])
    rows = []
    for name, label in (
        ("off", "resumption off (the baseline)"),
        ("memory", "resumption on, in-process store"),
        ("redis", "resumption on, `RedisStore` (each event also written to Redis)"),
    ):
        per_event = statistics.median(cost[name])
        rows.append(f"| {label} | {per_event:.2f} µs | {per_event / off:.2f} |")
    return "\n".join(
        [
            "## Resumable streams (`bench/resume.py`)",
            "",
            f"{platform.python_implementation()} {platform.python_version()}, "
            f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the end. "
            f"Resume latency: {args.probes} drops per row, each resumed 30 ms later on a new "
            "TCP connection (raw HTTP/1.1 client), the example servers as subprocesses on "
            "127.0.0.1 (engine step 5 ms).",
            "",
            "| resume latency: reconnect → first replayed event | p50 | p90 | target |",
            "|---|---:|---:|---|",
            f"| in process (one Starlette server) | {memory_p50:.2f} ms | "
            f"{ms(latency['memory'], 90):.2f} ms | ≤ 5 ms p50: {verdict[memory_p50 <= 5]} |",
            f"| through Redis (dropped on one server, resumed on the other) | "
            f"{redis_p50:.2f} ms | {ms(latency['redis'], 90):.2f} ms | "
            f"≤ 10 ms p50: {verdict[redis_p50 <= 10]} |",
            "",
            f"Cost per event: {args.streams} streams x {args.outputs} outputs, one output "
            "per live stream per loop step, each stream framed as SSE by a "
            "`tether.http.Exchange` (the write path minus the socket); wall time per event, "
            f"median of {args.rounds} interleaved rounds, ratio to the same-run baseline.",
            "",
            "| setting | per event | ratio |",
            "|---|---:|---:|",
            *rows,
            "",
            "Where it goes (cProfile): in process, the store's pump task per stream (one more "
            "task hop per event) and the event ids; through Redis, mostly redis-py packing "
            "one `XADD` per event in Python and reading its reply (hiredis does not change "
            "it: it parses replies, not commands); one pipeline per stream per round, so "
            "the round trips themselves overlap.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--probes", type=int, default=40, help="drops resumed per setting")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--outputs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        results = asyncio.run(measure(args))
        text = render(results, args)
        print(text)
        if not args.no_readme:
            rewrite_readme(RESULTS, text, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
