"""``make demo``: the example servers under real HTTP load, and what happened, as tables.

For each server (Starlette on uvicorn, aiohttp, then FastAPI on uvicorn) it starts the server as a
subprocess on 127.0.0.1 with an ephemeral port, drives it for a few seconds with
concurrent clients (one prompt or a batch, streamed or not, a quarter of them
abandoned part-way), checks every token against the engine's deterministic
tokens, then reads the server's ``/stats`` and prints a table.

Disconnect-to-abort latency is measured across the two processes: the client
notes ``time.monotonic()`` when it drops a connection, the server's engine notes
``time.monotonic()`` when tether calls its ``on_abort`` for that request id
(``GET /metrics/aborts``); both read the same system-wide clock.

Then the resumption scene (``resumescene.py``; ``--no-resume`` skips it): resumable
streams of which a quarter drop mid-stream and resume, each token exactly once, on
each server alone and on two servers sharing a ``redis-server`` (when one is on PATH).

Then the scale-out scene (``scaleout.py``; ``--no-scale-out`` skips it): one engine
process, two front workers per server over ZeroMQ, the same verified load, the
engine killed mid-run and restarted, one worker killed.

Exits 1 if any output was lost, repeated or out of order, any request got an
unexpected status, any abandoned request was not aborted, or anything was left
in flight (in the registry or in the engine) after the run.

    python examples/demo.py [--seconds 2] [--clients 16] [--server starlette|aiohttp|fastapi]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import resumescene
import scaleout
from launch import SERVERS, launched
from load import KINDS, Client, Tally

from tether.http import stop_tasks

LABELS = {
    "starlette": "Starlette on uvicorn",
    "aiohttp": "aiohttp",
    "fastapi": "FastAPI on uvicorn",
}


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples`` by the nearest-rank method; NaN if empty."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f} ms"


async def progress(name: str, tally: Tally, started: float, seconds: float) -> None:
    """Show the load as it runs: a bar on a terminal, a line a second otherwise."""
    tty = sys.stdout.isatty()
    while True:
        elapsed = min(seconds, time.monotonic() - started)
        done = int(20 * elapsed / seconds)
        line = (
            f"  {name:<9} [{'#' * done}{'.' * (20 - done)}] {elapsed:4.1f}/{seconds:.0f} s"
            f"  {tally.total('requests'):5d} requests  {tally.total('verified'):7d} tokens verified"
        )
        if tty:
            print("\r" + line, end="", flush=True)
        else:
            print(line, flush=True)
        await asyncio.sleep(0.2 if tty else 1.0)


async def settled(client: httpx.AsyncClient, *, timeout: float = 5.0) -> dict[str, Any]:
    """``/metrics`` once nothing is in flight (or as it is after ``timeout``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        metrics: dict[str, Any] = (await client.get("/stats")).json()
        engine = metrics["engine"]
        idle = metrics["in_flight"] == 0 and engine["running"] == 0 and engine["waiting"] == 0
        if idle or loop.time() > end:
            return metrics
        await asyncio.sleep(0.05)


async def drive(name: str, *, seconds: float, clients: int) -> bool:
    """Run the load against one server and print its table; returns whether all was well."""
    tally = Tally()
    async with launched(name) as url:
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
            # One connection per client before the clock starts, so that the first
            # requests do not also pay for connecting.
            await asyncio.gather(*(client.get("/health") for _ in range(clients)))
            started = time.monotonic()
            shower = asyncio.create_task(progress(name, tally, started, seconds))
            try:
                async with asyncio.TaskGroup() as group:
                    for i in range(clients):
                        load = Client(client, tally, f"{name}-c{i}", seed=i)
                        group.create_task(load.run(started + seconds))
            finally:
                await stop_tasks((shower,))
            elapsed = time.monotonic() - started
            if sys.stdout.isatty():
                print("\r" + " " * 100 + "\r", end="")
            metrics = await settled(client)
            aborts = dict((await client.get("/metrics/aborts")).json()["aborts"])
            exposition = (await client.get("/metrics")).text
    return report(name, url, tally, metrics, aborts, elapsed, clients, exposition)


SCRAPED = (
    "tether_requests_opened_total",
    "tether_requests_finished_total",
    "tether_requests_aborted_total",
    "tether_late_outputs_total",
    "tether_time_to_first_output_seconds_count",
    "tether_time_to_first_output_seconds_sum",
    "tether_request_duration_seconds_count",
)
"""The samples the demo shows of ``/metrics``."""


def report(
    name: str,
    url: str,
    tally: Tally,
    metrics: dict[str, Any],
    aborts: dict[str, float],
    elapsed: float,
    clients: int,
    exposition: str = "",
) -> bool:
    """Print one server's table; returns whether the run was clean.

    :param exposition: the server's ``GET /metrics`` (Prometheus text), of which a
        few lines are shown as a scraper sees them."""
    latencies = [aborts[rid] - t for rid, t in tally.disconnects.items() if rid in aborts]
    unaborted = [rid for rid in tally.disconnects if rid not in aborts]
    engine = metrics["engine"]
    print(f"{LABELS[name]} at {url}: {clients} clients for {elapsed:.1f} s")
    header = f"  {'kind':<14}{'requests':>9}{'complete':>9}{'dropped':>8}"
    header += f"{'outputs':>9}{'verified':>9}{'1st out p50':>13}{'p99':>10}"
    print(header)
    for kind in KINDS:
        row = tally.kinds[kind]
        print(
            f"  {kind:<14}{row.requests:>9}{row.completed:>9}{row.disconnected:>8}"
            f"{row.outputs:>9}{row.verified:>9}{ms(percentile(row.first_output, 0.5)):>13}"
            f"{ms(percentile(row.first_output, 0.99)):>10}"
        )
    outputs, verified = tally.total("outputs"), tally.total("verified")
    print(
        f"  {'total':<14}{tally.total('requests'):>9}{tally.total('completed'):>9}"
        f"{tally.total('disconnected'):>8}{outputs:>9}{verified:>9}"
    )
    print(
        f"  throughput: {verified / elapsed:,.0f} tokens/s verified,"
        f" {tally.total('requests') / elapsed:,.1f} requests/s"
    )
    # A request abandoned before the server read it was never registered: nothing to abort.
    unsent = tally.sub_requests - metrics["opened"]
    print(
        f"  disconnect -> abort: p50 {ms(percentile(latencies, 0.5))},"
        f" p99 {ms(percentile(latencies, 0.99))} over {len(latencies)} aborted sub-requests"
        + (f", +{unsent} dropped before the server read them" if unsent else "")
    )
    print(
        f"  late outputs: {metrics['late_outputs']}   in_flight after run: {metrics['in_flight']}"
        f"   engine slots after run: {engine['running'] + engine['waiting']}"
    )
    problems = list(tally.errors)
    if outputs != verified:
        problems.append(f"{outputs - verified} outputs lost or out of order")
    if len(unaborted) != unsent:
        problems.append(f"{len(unaborted)} abandoned requests never aborted: {unaborted[:3]}")
    if metrics["in_flight"] or engine["running"] or engine["waiting"]:
        problems.append("state left in flight after the run")
    scraped = [line for line in exposition.splitlines() if line.startswith(SCRAPED)]
    scraped = [line for line in scraped if not line.endswith(" 0.0")]  # the reasons seen
    if scraped:
        print("  scraped from /metrics (Prometheus):")
        for line in scraped:
            print(f"    {line}")
    for problem in problems[:10]:
        print(f"  FAIL: {problem}")
    print(f"  {'FAILED' if problems else 'OK'}\n")
    return not problems


async def run(servers: Sequence[str], *, seconds: float, clients: int) -> bool:
    """Drive each server in turn (one at a time: the machine may have few cores)."""
    clean = True
    for name in servers:
        clean = await drive(name, seconds=seconds, clients=clients) and clean
    return clean


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the exit status (0 when every check passed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=2.0, help="load time per server")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients per server")
    parser.add_argument("--server", choices=sorted(SERVERS), action="append", help="default: all")
    parser.add_argument(
        "--scale-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the scale-out scene (engine process + 2 workers, scaleout.py)",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the resumption scene (drops resumed, resumescene.py)",
    )
    args = parser.parse_args(argv)
    servers = args.server or ["starlette", "aiohttp", "fastapi"]
    print(f"tether demo: {', '.join(servers)}; {args.clients} clients, {args.seconds:g} s each\n")
    clean = asyncio.run(run(servers, seconds=args.seconds, clients=args.clients))
    if args.resume:
        scene = resumescene.run(servers, seconds=args.seconds, clients=args.clients)
        clean = asyncio.run(scene) and clean
    if args.scale_out:
        # (the FastAPI example has no --engine/--workers: the scene runs the other two)
        remote = [name for name in servers if name in ("starlette", "aiohttp")]
        scene = scaleout.run(remote, seconds=args.seconds, clients=args.clients)
        clean = asyncio.run(scene) and clean
    print("all checks passed" if clean else "some checks FAILED")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
