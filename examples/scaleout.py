"""``make demo``'s scale-out scene: one engine process, two front workers, over ZeroMQ.

For each server it starts ``engine_server.py`` on an ipc:// address and the server
with ``--engine ADDRESS --workers 2``, then:

1. **verified load**: the demo's load for a few seconds, every token checked;
   afterwards the engine holds nothing (its counters, read with SIGUSR1);
2. **engine kill -9 mid-run**: long streams are running; the engine is killed;
   every stream must end with an error event (a 503) within a bound, new requests
   get 503 with ``Retry-After``; the engine restarts at the same address and the
   workers, which reconnect by themselves, serve verified requests again;
3. **front worker kill -9**: long streams are running on both workers; one worker
   is killed; the engine must abort exactly the requests of that worker (its
   streams broke), and the other worker's streams complete, verified.

Exits through :func:`run`'s result: ``False`` when a check failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from engine import expected_text
from launch import SERVERS
from load import Client, Tally

from tether.http import stop_tasks

HERE = pathlib.Path(__file__).resolve().parent
FAIL_BOUND = 1.0
"""Seconds within which every stream must have failed after the engine's kill -9."""


@dataclasses.dataclass
class Spawned:
    """A process of the scene and the lines it printed so far."""

    process: asyncio.subprocess.Process
    lines: list[str]
    reader: asyncio.Task[None]

    async def line(self, marker: str, *, timeout: float = 30.0) -> str:
        async with asyncio.timeout(timeout):
            while True:
                for line in self.lines:
                    if marker in line:
                        return line
                if self.reader.done():
                    raise RuntimeError("exited:\n" + "\n".join(self.lines))
                await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def spawned(*args: str) -> AsyncIterator[Spawned]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines: list[str] = []

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            lines.append(raw.decode(errors="replace").rstrip())

    helper = Spawned(process, lines, asyncio.create_task(read()))
    try:
        yield helper
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
        await process.wait()
        await helper.reader


async def engine_stats(engine: Spawned) -> dict[str, Any]:
    """The engine's counters: it prints them as one JSON line on SIGUSR1."""
    before = len(engine.lines)
    engine.process.send_signal(signal.SIGUSR1)
    async with asyncio.timeout(10):
        while True:
            for line in engine.lines[before:]:
                if line.startswith("{"):
                    stats: dict[str, Any] = json.loads(line)
                    return stats
            await asyncio.sleep(0.01)


async def engine_idle(engine: Spawned) -> dict[str, Any]:
    """The engine's counters once nothing runs in it (bounded: 5 s)."""
    end = time.monotonic() + 5
    while True:
        stats = await engine_stats(engine)
        busy = stats["engine"]["running"] + stats["engine"]["waiting"] + stats["link"]["in_flight"]
        if not busy or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.05)


@dataclasses.dataclass
class Outcome:
    """How one long stream ended."""

    tokens: int = 0
    verified: bool = False
    error_event: bool = False
    error: str = ""
    broken: bool = False
    first: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    ended_at: float = 0.0


async def long_stream(
    client: httpx.AsyncClient, prompt: str, tokens: int, outcome: Outcome
) -> Outcome:
    """One streamed request of ``tokens`` tokens, read to its end whatever happens."""
    text = ""
    body = {"text": prompt, "max_tokens": tokens, "stream": True}
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                out = json.loads(line[6:])
                if "error" in out:
                    outcome.error_event = True
                    outcome.error = outcome.error or str(out["error"].get("message"))
                    continue
                text += out["text"]  # (a slow reader gets merged deltas: count the text)
                outcome.tokens = int(out["meta_info"]["completion_tokens"])
                outcome.first.set()
    except httpx.TransportError as exc:  # the worker serving it was killed
        outcome.broken = True
        outcome.error = repr(exc)
    outcome.ended_at = time.monotonic()
    outcome.verified = outcome.tokens == tokens and text == expected_text(prompt, tokens)
    outcome.first.set()
    return outcome


async def running_streams(
    client: httpx.AsyncClient, label: str, count: int, tokens: int
) -> tuple[list[Outcome], list[asyncio.Task[Outcome]]]:
    """Start ``count`` long streams; returns once each has its first token (bounded)."""
    outcomes = [Outcome() for _ in range(count)]
    readers = [
        asyncio.create_task(long_stream(client, f"{label} {i}", tokens, outcome))
        for i, outcome in enumerate(outcomes)
    ]
    async with asyncio.timeout(10):
        for outcome, reader in zip(outcomes, readers, strict=True):
            first = asyncio.create_task(outcome.first.wait())
            try:
                await asyncio.wait((first, reader), return_when=asyncio.FIRST_COMPLETED)
            finally:
                await stop_tasks((first,))
            if reader.done():
                reader.result()  # a reader that died says why now, not as a timeout later
    return outcomes, readers


async def health(client: httpx.AsyncClient, *, times: int) -> bool:
    """Whether ``/health`` answered 200 ``times`` in a row (both workers, likely)."""
    for _ in range(times):
        if (await client.get("/health")).status_code != 200:
            return False
    return True


async def until_healthy(client: httpx.AsyncClient, engine: Spawned, fronts: int = 2) -> None:
    """Poll (bounded: 10 s) until the engine has a session with every worker and the
    workers answer ``/health`` with 200: conditions in other processes, with no event
    to wait on. (``/health`` alone may reach one worker only: the other, still
    without its session, would answer the load's first requests with 503.)"""
    async with asyncio.timeout(10):
        while True:
            stats = await engine_stats(engine)
            if stats["link"]["fronts"] >= fronts and await health(client, times=4):
                return
            await asyncio.sleep(0.02)


async def verified_load(
    client: httpx.AsyncClient, name: str, seconds: float, clients: int
) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    async with asyncio.TaskGroup() as group:
        for i in range(clients):
            group.create_task(Client(client, tally, f"{name}-so{i}", seed=i).run(deadline))
    return tally


async def scene(name: str, *, seconds: float, clients: int) -> bool:
    """The scale-out scene for one server; prints its table, returns whether it was clean."""
    directory = tempfile.mkdtemp(prefix="tether-demo-")
    address = f"ipc://{directory}/engine"
    engine_cmd = (str(HERE / "engine_server.py"), "--address", address)
    problems: list[str] = []
    rows: list[str] = []
    try:
        engine_cm = spawned(*engine_cmd)
        engine = await engine_cm.__aenter__()
        try:
            await engine.line("listening on")
            server_args = (str(SERVERS[name]), "--port", "0", "--engine", address, "--workers", "2")
            async with spawned(*server_args) as server:
                pids = [int(p) for p in (await server.line("workers:")).split(":")[1].split()]
                url = (await server.line("listening on")).rsplit("listening on ", 1)[1]
                limits = httpx.Limits(max_connections=clients + 40, max_keepalive_connections=0)
                async with httpx.AsyncClient(
                    base_url=url.rstrip("/"), limits=limits, timeout=30
                ) as client:
                    await until_healthy(client, engine)
                    # 1. verified load across both workers
                    tally = await verified_load(client, name, seconds, clients)
                    stats = await engine_idle(engine)
                    outputs, verified = tally.total("outputs"), tally.total("verified")
                    rows.append(
                        f"verified load: {tally.total('requests')} requests, {verified} tokens "
                        f"verified of {outputs}; engine fronts {stats['link']['fronts']}, "
                        f"in flight after {stats['link']['in_flight']}"
                    )
                    problems += tally.errors[:5]
                    if outputs != verified:
                        problems.append(f"{outputs - verified} tokens lost or out of order")
                    if stats["link"]["in_flight"] or stats["engine"]["running"]:
                        problems.append("the engine held requests after the load")
                    # 2. the engine killed mid-run
                    problems += await engine_kill(client, engine, rows)
                    await engine_cm.__aexit__(None, None, None)
                    engine_cm = spawned(*engine_cmd)
                    engine = await engine_cm.__aenter__()
                    await engine.line("listening on")
                    await until_healthy(client, engine)
                    again = await verified_load(client, name, 1.0, 4)
                    rows.append(
                        f"engine restarted: {again.total('requests')} requests, "
                        f"{again.total('verified')} tokens verified"
                    )
                    problems += again.errors[:5]
                    # 3. one front worker killed
                    problems += await worker_kill(client, engine, pids[0], rows)
        finally:
            await engine_cm.__aexit__(None, None, None)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"Scale-out: {name}, one engine process + 2 workers over {address}")
    for row in rows:
        print(f"  {row}")
    for problem in problems[:10]:
        print(f"  FAIL: {problem}")
    print(f"  {'FAILED' if problems else 'OK'}\n")
    return not problems


async def engine_kill(client: httpx.AsyncClient, engine: Spawned, rows: list[str]) -> list[str]:
    problems = []
    outcomes, readers = await running_streams(client, "doomed", 16, 400)
    killed_at = time.monotonic()
    engine.process.kill()
    async with asyncio.timeout(10):
        await asyncio.gather(*readers)
    latest = max(o.ended_at for o in outcomes) - killed_at
    failed = sum(o.error_event for o in outcomes)
    refused = await client.post("/generate", json={"text": "x", "max_tokens": 2})
    rows.append(
        f"engine kill -9 mid-run: {failed}/{len(outcomes)} streams ended with an error event, "
        f"the last {latest * 1000:.0f} ms after the kill; a new request got "
        f"{refused.status_code} (Retry-After: {refused.headers.get('retry-after')})"
    )
    if failed != len(outcomes):
        problems.append(f"{len(outcomes) - failed} streams did not fail after the engine's kill")
    if latest > FAIL_BOUND:
        problems.append(f"streams failed {latest:.2f}s after the kill (bound {FAIL_BOUND}s)")
    if refused.status_code != 503 or "retry-after" not in refused.headers:
        problems.append(f"with no engine, a request got {refused.status_code}, not 503")
    return problems


async def worker_kill(
    client: httpx.AsyncClient, engine: Spawned, pid: int, rows: list[str]
) -> list[str]:
    problems = []
    # (the baseline once the earlier load's aborts have all reached the engine: one
    # still on its way would be counted against this worker's kill)
    before = (await engine_idle(engine))["link"]["cancelled"]
    tokens = 300
    outcomes, readers = await running_streams(client, "spread", 16, tokens)
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(30):
        await asyncio.gather(*readers)
    stats = await engine_idle(engine)
    broken = sum(o.broken for o in outcomes)
    completed = sum(o.verified for o in outcomes)
    cancelled = stats["link"]["cancelled"] - before
    rows.append(
        f"worker {pid} kill -9: {broken} of its streams broke, the engine aborted "
        f"{cancelled} requests; {completed} streams on the other worker completed, verified; "
        f"engine in flight after {stats['link']['in_flight']}"
    )
    if broken + completed != len(outcomes):
        odd = [o for o in outcomes if not o.broken and not o.verified]
        problems.append(
            f"{len(odd)} streams neither broke nor completed, e.g. {odd[0].tokens} tokens, "
            f"{odd[0].error or 'no error'}"
        )
    if cancelled != broken:
        problems.append(f"the engine aborted {cancelled} requests for {broken} broken streams")
    if stats["link"]["in_flight"]:
        problems.append("the engine held requests after the worker's kill")
    return problems


async def run(servers: Sequence[str], *, seconds: float, clients: int) -> bool:
    """The scene for each server in turn; whether every check passed."""
    clean = True
    for name in servers:
        clean = await scene(name, seconds=seconds, clients=clients) and clean
    return clean
