"""The one load client of every HTTP benchmark: raw HTTP/1.1 over asyncio protocols.

It runs in its own process and prints one JSON line of results. It is kept lean
so that it is never the bottleneck: a response body is never parsed beyond
counting SSE events (``data: {``) and spotting the chunked terminator, and every
connection is kept alive across requests.

Modes:

* ``stream`` / ``json``: ``--concurrency`` clients each send requests back to
  back for ``--warmup`` + ``--duration`` seconds; the measured window reports
  events/s, requests/s, time to first event (``json``: to the whole response)
  p50/p99, and, with ``--server-pid``, the server's CPU time per event.
* ``abort``: ``--tries`` clients each open one request, disconnect at a random
  moment, and note ``time.monotonic()`` just before closing; the server notes
  the same clock (system-wide ``CLOCK_MONOTONIC`` on Linux) in ``on_abort`` and
  the client reads those back from ``/_bench/aborts``: close-to-abort p50/p99.
* ``idle``: holds ``--streams`` streams open after their first event and
  reports the server's resident memory growth per open stream.
* ``plan``: the URL is a JSON file of ``stream``/``json`` runs, each a list of this
  command line's arguments; they run one after the other in this one process (no
  interpreter start between the paired runs of a benchmark matrix), and the output
  is one JSON list of their results, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

from .stats import cpu_seconds, percentile, rss_bytes

__all__ = ["Connection", "main"]

EVENT = b"data: {"
CHUNKED_END = b"\r\n0\r\n\r\n"


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that sends one GET at a time.

    :param counter: a one-item list every received event is added to, so the
        measured window can be cut at any moment.
    """

    def __init__(self, host: str, counter: list[int]) -> None:
        self._host = host
        self._counter = counter
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = self._loop.create_future()
        self._done: asyncio.Future[None] | None = None
        self.first_event: asyncio.Future[None] | None = None
        self.on_first: Callable[[float], None] | None = None
        """Called with the time to first event (to the whole body, for JSON)."""
        self._reset()

    def _reset(self) -> None:
        self._head = b""
        self._in_body = False
        self._length: int | None = None
        self._tail = b"\r\n"
        self.status = 0
        self.events = 0
        self.body = b""
        self.sent_at = 0.0
        self.first_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        for future in (self._done, self.first_event):
            if future is not None and not future.done():
                future.set_exception(ConnectionError("the connection closed mid-response"))
                future.exception()  # whoever awaits it still gets it; nobody else warns

    def get(self, path: str) -> asyncio.Future[None]:
        """Send ``GET path``; the future is done when the whole response is in."""
        assert self.transport is not None
        self._reset()
        self._done = self._loop.create_future()
        self.first_event = self._loop.create_future()
        self.sent_at = time.perf_counter()
        self.transport.write(f"GET {path} HTTP/1.1\r\nHost: {self._host}\r\n\r\n".encode())
        return self._done

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            head = self._head + data
            end = head.find(b"\r\n\r\n")
            if end < 0:
                self._head = head
                return
            self._parse_head(head[:end])
            data = head[end + 4 :]
            self._in_body = True
        if self._length is not None:
            self.body += data
            if len(self.body) >= self._length:
                self._first()
                self._finish()
            return
        chunk = self._tail + data
        found = chunk.count(EVENT, 1)
        if found:
            if not self.events:
                self._first()
            self.events += found
            self._counter[0] += found
        if chunk.endswith(CHUNKED_END):
            self._finish()
        self._tail = chunk[-len(CHUNKED_END) :]

    def _first(self) -> None:
        self.first_at = time.perf_counter()
        if self.on_first is not None:
            self.on_first(self.first_at - self.sent_at)
        if self.first_event is not None and not self.first_event.done():
            self.first_event.set_result(None)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                self._length = int(value)

    def _finish(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)


async def connect(url: str, counter: list[int]) -> Connection:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    _, protocol = await asyncio.get_running_loop().create_connection(
        lambda: Connection(f"{host}:{port}", counter), host, port
    )
    return protocol


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _path(url: str) -> str:
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


async def load(args: argparse.Namespace) -> dict[str, Any]:
    """``stream``/``json``: back-to-back requests from ``--concurrency`` clients."""
    counter = [0]
    path = _path(args.url)
    window: dict[str, float] = {}
    latencies: list[float] = []
    tally = {"requests": 0, "bad": 0}
    stop = asyncio.Event()
    enough = asyncio.Event()  # the window has seen --min-requests end in it

    def noted(latency: float) -> None:
        if "start" in window and not stop.is_set():
            latencies.append(latency)

    async def client() -> None:
        connection = await connect(args.url, counter)
        try:
            while not stop.is_set():
                await connection.get(path)
                # Latencies leave out each client's first request (all clients send it
                # at once, in one wave) and count when the first event lands in the
                # window; requests count in the window they end in.
                connection.on_first = noted
                if "start" not in window or stop.is_set():
                    continue
                tally["requests"] += 1
                if tally["requests"] >= args.min_requests:
                    enough.set()
                if connection.status != 200 or (args.expect and connection.events != args.expect):
                    tally["bad"] += 1
        finally:
            if connection.transport is not None:
                connection.transport.close()

    tasks = [asyncio.create_task(client()) for _ in range(args.concurrency)]
    try:
        await asyncio.sleep(args.warmup)
        window.update(start=time.perf_counter(), cpu=cpu_seconds(args.server_pid))
        events0, own0 = counter[0], time.process_time()
        await asyncio.sleep(args.duration)
        if args.min_requests:
            # A smoke run on a loaded machine: a window too short for one whole
            # response stays open until one ends in it, instead of measuring nothing.
            await asyncio.wait_for(enough.wait(), 120)
        elapsed = time.perf_counter() - window["start"]
        events = counter[0] - events0
        server_cpu = cpu_seconds(args.server_pid) - window["cpu"]
        own_cpu = time.process_time() - own0
        stop.set()
        failed = [task for task in tasks if task.done() and task.exception() is not None]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        raise RuntimeError(f"{len(failed)} clients failed: {failed[0].exception()!r}")
    requests = tally["requests"]
    return {
        "events_per_s": events / elapsed,
        "requests_per_s": requests / elapsed,
        "ttfe_p50_ms": _ms(percentile(latencies, 50)),
        "ttfe_p99_ms": _ms(percentile(latencies, 99)),
        "server_cpu_us_per_event": server_cpu / events * 1e6 if events else None,
        "server_cpu_us_per_request": server_cpu / requests * 1e6 if requests else None,
        "server_cpu_share": server_cpu / elapsed,
        "client_cpu_share": own_cpu / elapsed,
        "bad_responses": tally["bad"],
        "requests": requests,
    }


async def abort(args: argparse.Namespace) -> dict[str, Any]:
    """``abort``: each try disconnects at a random moment; close-to-``on_abort`` times."""
    path = _path(args.url)
    sep = "&" if "?" in path else "?"
    tag = f"{random.getrandbits(32):08x}"
    counter = [0]

    async def attempt(k: int) -> tuple[str, float]:
        await asyncio.sleep(k * args.stagger)
        rid = f"{tag}-{k}"
        connection = await connect(args.url, counter)
        connection.get(f"{path}{sep}rid={rid}")
        if args.streaming:
            assert connection.first_event is not None
            await connection.first_event
        else:
            await asyncio.sleep(random.uniform(0.05, 0.15))
        await asyncio.sleep(random.uniform(0.0, args.max_delay))
        closed_at = time.monotonic()
        assert connection.transport is not None
        connection.transport.close()
        return rid, closed_at

    closes = dict(await asyncio.gather(*(attempt(k) for k in range(args.tries))))
    aborts: dict[str, float] = {}
    deadline = time.monotonic() + args.deadline
    while time.monotonic() < deadline and not closes.keys() <= aborts.keys():
        await asyncio.sleep(0.05)
        connection = await connect(args.url, counter)
        await connection.get("/_bench/aborts")
        aborts.update(json.loads(connection.body))
        assert connection.transport is not None
        connection.transport.close()
    latencies = [
        (aborts[rid] - closed_at) * 1e3 for rid, closed_at in closes.items() if rid in aborts
    ]
    return {
        "tries": args.tries,
        "missed": args.tries - len(latencies),
        "latencies_ms": sorted(latencies),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
    }


async def idle(args: argparse.Namespace) -> dict[str, Any]:
    """``idle``: server memory growth per stream held open after its first event."""
    counter = [0]
    path = _path(args.url)

    async def open_streams(count: int) -> list[Connection]:
        opened: list[Connection] = []
        for start in range(0, count, 200):
            batch = await asyncio.gather(
                *(connect(args.url, counter) for _ in range(min(200, count - start)))
            )
            for connection in batch:
                connection.get(path)
            await asyncio.gather(*(c.first_event for c in batch if c.first_event is not None))
            opened.extend(batch)
        return opened

    def close(connections: list[Connection]) -> None:
        for connection in connections:
            if connection.transport is not None:
                connection.transport.close()

    warm = await open_streams(min(200, args.streams))  # code paths and free lists
    close(warm)
    await asyncio.gather(*(c.closed for c in warm))
    await asyncio.sleep(args.settle)
    before = rss_bytes(args.server_pid)
    held = await open_streams(args.streams)
    await asyncio.sleep(args.settle)
    after = rss_bytes(args.server_pid)
    close(held)
    await asyncio.gather(*(c.closed for c in held))
    return {
        "streams": args.streams,
        "rss_before_mib": before / 2**20,
        "rss_after_mib": after / 2**20,
        "bytes_per_stream": (after - before) / args.streams,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="tether's HTTP benchmark load client")
    parser.add_argument("mode", choices=["stream", "json", "abort", "idle", "plan"])
    parser.add_argument("url", help="http://127.0.0.1:<port>/<path>")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=2.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    parser.add_argument(
        "--min-requests", type=int, default=0, help="keep the window open until this many end"
    )
    parser.add_argument("--expect", type=int, default=0, help="events per response (0: any)")
    parser.add_argument("--server-pid", type=int, default=0, help="for CPU and memory readings")
    parser.add_argument("--tries", type=int, default=50)
    parser.add_argument("--streaming", action="store_true", help="abort: the URL streams")
    parser.add_argument("--stagger", type=float, default=0.02, help="abort: seconds between tries")
    parser.add_argument(
        "--max-delay", type=float, default=0.1, help="abort: random wait before closing, at most"
    )
    parser.add_argument("--deadline", type=float, default=6.0, help="abort: wait for on_abort")
    parser.add_argument("--streams", type=int, default=2000, help="idle: streams to hold")
    parser.add_argument("--settle", type=float, default=0.5, help="idle: seconds before RSS")
    return parser.parse_args(argv)


async def plan(runs: list[argparse.Namespace]) -> list[dict[str, Any]]:
    """``plan``: every run, in order."""
    return [await load(run) for run in runs]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        if args.mode == "plan":
            with open(args.url) as file:
                runs = [parse_args([str(arg) for arg in line]) for line in json.load(file)]
            if any(run.mode not in ("stream", "json") for run in runs):
                raise ValueError("a plan holds stream and json runs only")
            result: Any = runner.run(plan(runs))
        else:
            run = {"stream": load, "json": load, "abort": abort, "idle": idle}[args.mode]
            result = runner.run(run(args))
    print(json.dumps(result), flush=True)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: it halves the client's CPU per event, keeping the
    client further from being the bottleneck (servers stay on asyncio's loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    main()
