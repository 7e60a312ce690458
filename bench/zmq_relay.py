"""The ZeroMQ link's benchmark: outputs relayed engine → front → registry → consumer.

One engine process (this script with ``--engine``) serves ``tether_zmq.EngineServer``
on ipc://; this process is the front. Three measurements, in one run:

* **relay**: ``--requests`` endless requests, each step sends one output to every
  live one, until each got ``--outputs``; the front feeds them into a
  ``tether.Registry`` and one task per request reads its stream (``async for``).
  Reported as outputs per second, from the first submission to the last output read.
* **bare pyzmq relay**: the same engine sending the same frames to a bare DEALER
  that does the handshake by hand and relays every output to the same consumers
  through a ``dict`` of ``asyncio.Queue`` (what a server writes without tether);
  the ratio of the two is what tether's front costs against that.
* **transport ceiling**: the same frames received and decoded (the envelope and
  every payload) with no consumer at all: what pyzmq and msgspec alone cost.
* **time to first output**: one request at a time, the engine answering each
  submission at once, against an in-process producer that delivers on the next
  loop tick; the difference of the two medians is what the link adds.

Then the section between ``<!-- zmq:begin -->`` and ``<!-- zmq:end -->`` of
``bench/RESULTS.md`` is rewritten. Run it with ``make bench`` or
``python bench/zmq_relay.py`` (``--no-readme`` to leave it alone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import tether
import tether_zmq._protocol as wire  # the bare baseline speaks the wire format by hand
from tether_zmq import Cancellation, EngineClient, EngineServer, RequestKey, Submission

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- zmq:begin -->", "<!-- zmq:end -->"


# -- the engine process -----------------------------------------------------------------


async def engine_main(address: str) -> None:
    """Serve until killed: ``{"n": k}`` gets ``k`` outputs, one per step; ``n == 1``
    requests are answered at once, on receipt (the time-to-first-output probe)."""
    jobs: dict[RequestKey, list[int]] = {}
    async with EngineServer(address, peer_timeout=5.0) as server:
        print("ready", flush=True)
        while True:
            events = await server.receive() if not jobs else server.receive_nowait()
            for event in events:
                if isinstance(event, Submission):
                    count = int(event.request["n"])
                    if count == 1:
                        server.send([(event.key, {"text": " hi", "i": 1}, True)])
                    else:
                        jobs[event.key] = [0, count]
                elif isinstance(event, Cancellation):
                    jobs.pop(event.key, None)
            if jobs:
                outputs = []
                for key, job in list(jobs.items()):
                    job[0] += 1
                    finished = job[0] >= job[1]
                    outputs.append((key, {"text": " token", "i": job[0]}, finished))
                    if finished:
                        del jobs[key]
                server.send(outputs)
                await asyncio.sleep(0)  # one step per loop turn: the fronts' pings get answered


# -- the front ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def engine_process(address: str) -> AsyncIterator[None]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--engine", address, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            await process.stdout.readline()
        yield
    finally:
        process.kill()
        await process.wait()


async def relay_tether(
    address: str, requests: int, outputs: int, *, byte_bound: bool = True
) -> float:
    """tether's front; ``byte_bound=False`` lifts the registry's per-request byte budget
    (``max_pending_bytes=None``), as unbounded as the bare relay's queues."""
    client = EngineClient(address, engine_timeout=5.0)
    registry = tether.Registry(
        on_abort=client.on_abort,
        max_pending=1_000_000,
        **({} if byte_bound else {"max_pending_bytes": None}),
    )
    async with client.running(registry):
        async with asyncio.timeout(30):
            await client.wait_ready()
        received = 0

        async def read(stream: tether.Stream) -> None:
            nonlocal received
            async for _ in stream:
                received += 1

        started = time.perf_counter()
        streams = [client.open({"n": outputs}) for _ in range(requests)]
        await asyncio.gather(*(read(stream) for stream in streams))
        elapsed = time.perf_counter() - started
    assert received == requests * outputs, received
    return received / elapsed


@contextlib.asynccontextmanager
async def bare_session(address: str) -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.Socket[bytes]]]:
    """A bare DEALER with the handshake done by hand: no tether on this side."""
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    try:
        await socket.send(wire.encode(wire.Hello(0, wire.PROTOCOL_VERSION, "bare", 1, 1 << 30)))
        async with asyncio.timeout(30):
            assert isinstance(wire.decode(await socket.recv()), wire.Welcome)
        yield socket, zmq.Socket.shadow(socket.underlying)
    finally:
        socket.close(linger=0)


def submit_frame(requests: int, outputs: int) -> bytes:
    payload = msgspec.msgpack.encode({"n": outputs})
    return wire.encode(wire.Submit(1, [(i, f"r{i}", payload) for i in range(requests)]))


async def relay_decode_only(address: str, requests: int, outputs: int) -> float:
    """The transport's ceiling: receive and decode every frame and payload, nothing else."""
    decode_payload = msgspec.msgpack.Decoder().decode
    async with bare_session(address) as (socket, shadow):
        started = time.perf_counter()
        await socket.send(submit_frame(requests, outputs))
        received, total = 0, requests * outputs
        while received < total:
            await socket.poll()
            while True:
                try:
                    frame = shadow.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = wire.decode(frame)
                if isinstance(message, wire.Step):
                    for _rid, data, _finished in message.outputs:
                        decode_payload(data)
                        received += 1
        elapsed = time.perf_counter() - started
    return received / elapsed


async def relay_by_hand(address: str, requests: int, outputs: int) -> float:
    """What a server writes without tether: a dict ``rid -> asyncio.Queue`` that the
    receiving loop fills and one task per request reads, on the same frames."""
    decode_payload = msgspec.msgpack.Decoder().decode
    queues: dict[int, asyncio.Queue[tuple[Any, bool]]] = {
        i: asyncio.Queue() for i in range(requests)
    }
    received = 0

    async def read(queue: asyncio.Queue[tuple[Any, bool]]) -> None:
        nonlocal received
        while True:
            _, finished = await queue.get()
            received += 1
            if finished:
                return

    async def pump(socket: zmq.asyncio.Socket, shadow: zmq.Socket[bytes]) -> None:
        while queues:
            await socket.poll()
            for _ in range(512):  # as tether's reader: a bounded drain per wake-up
                try:
                    frame = shadow.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = wire.decode(frame)
                if isinstance(message, wire.Step):
                    for sid, data, finished in message.outputs:  # (by submission id)
                        queue = queues[sid]
                        queue.put_nowait((decode_payload(data), finished))
                        if finished:
                            del queues[sid]

    async with bare_session(address) as (socket, shadow):
        readers = [read(queue) for queue in queues.values()]
        started = time.perf_counter()
        await socket.send(submit_frame(requests, outputs))
        await asyncio.gather(pump(socket, shadow), *readers)
        elapsed = time.perf_counter() - started
    assert received == requests * outputs, received
    return received / elapsed


async def first_output_link(address: str, count: int) -> list[float]:
    client = EngineClient(address, engine_timeout=5.0)
    registry = tether.Registry(on_abort=client.on_abort)
    times = []
    async with client.running(registry):
        async with asyncio.timeout(30):
            await client.wait_ready()
        for _ in range(count):
            started = time.perf_counter()
            stream = client.open({"n": 1})
            async for _ in stream:
                times.append(time.perf_counter() - started)
                break
            await stream.aclose()
    return times


async def first_output_local(count: int) -> list[float]:
    registry = tether.Registry()
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        stream = registry.open()
        loop.call_soon(registry.deliver_many, [(stream.rid, {"text": " hi", "i": 1}, True)])
        async for _ in stream:
            times.append(time.perf_counter() - started)
        await stream.aclose()
    return times


async def front_main(args: argparse.Namespace) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="tzb-")
    address = f"ipc://{directory}/engine"
    results: dict[str, Any] = {"tether": [], "unbounded": [], "by_hand": [], "decode_only": []}
    try:
        async with engine_process(address):
            for _ in range(args.rounds):  # interleaved, so that both see the same machine
                gc.collect()
                results["decode_only"].append(
                    await relay_decode_only(address, args.requests, args.outputs)
                )
                gc.collect()
                results["by_hand"].append(await relay_by_hand(address, args.requests, args.outputs))
                gc.collect()
                results["tether"].append(await relay_tether(address, args.requests, args.outputs))
                gc.collect()
                results["unbounded"].append(
                    await relay_tether(address, args.requests, args.outputs, byte_bound=False)
                )
            results["ttfo_link"] = await first_output_link(address, args.probes)
        results["ttfo_local"] = await first_output_local(args.probes)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return results


# -- the report ---------------------------------------------------------------------------


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    tether_rate = statistics.median(results["tether"])
    unbounded = statistics.median(results["unbounded"])
    bare_rate = statistics.median(results["by_hand"])
    ceiling = statistics.median(results["decode_only"])
    link = statistics.median(results["ttfo_link"]) * 1e3
    local = statistics.median(results["ttfo_local"]) * 1e3
    link_p99 = statistics.quantiles(results["ttfo_link"], n=100)[98] * 1e3
    ratio = tether_rate / bare_rate
    verdict = {True: "met", False: "**not met**"}
    return "\n".join(
        [
            "## ZeroMQ link (`bench/zmq_relay.py`)",
            "",
            f"{platform.python_implementation()} {platform.python_version()}, "
            f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), {os.cpu_count()} CPUs; "
            f"load average {os.getloadavg()[0]:.1f} at the end; engine and front as two "
            f"processes on ipc://; {args.requests} requests x {args.outputs} outputs, median "
            f"of {args.rounds} interleaved rounds.",
            "",
            "| measure | value | target |",
            "|---|---:|---|",
            f"| outputs relayed engine → front → registry → consumer | "
            f"{tether_rate:,.0f}/s | ≥ 100,000/s: {verdict[tether_rate >= 100_000]} |",
            f"| bare pyzmq relay of the same frames to the same consumers "
            f"(dict of `asyncio.Queue`, no tether) | {bare_rate:,.0f}/s | |",
            f"| ratio tether / bare relay | {ratio:.2f} | ≥ 0.8: {verdict[ratio >= 0.8]} |",
            f"| tether, registry without the byte budget (`max_pending_bytes=None`, as "
            f"unbounded as the bare relay) | {unbounded:,.0f}/s ({unbounded / bare_rate:.2f}x) "
            f"| ≥ 0.8: {verdict[unbounded / bare_rate >= 0.8]} |",
            f"| transport ceiling: the same frames received and decoded, no consumer | "
            f"{ceiling:,.0f}/s | |",
            f"| time to first output over the link (p50 / p99) | {link:.3f} / "
            f"{link_p99:.3f} ms | |",
            f"| time to first output, in-process producer (p50) | {local:.3f} ms | |",
            f"| added by the link (p50) | {link - local:.3f} ms | ≤ 0.5 ms: "
            f"{verdict[link - local <= 0.5]} |",
        ]
    )


def rewrite_readme(text: str) -> None:
    block = f"{BEGIN}\n{text}\n{END}"
    current = RESULTS.read_text()
    start, end = current.find(BEGIN), current.find(END)
    if start == -1 or end == -1:
        updated = current.rstrip("\n") + "\n\n" + block + "\n"
    else:
        updated = current[:start] + block + current[end + len(END) :]
    RESULTS.write_text(updated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=500)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    if args.engine:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(engine_main(args.engine))
        return
    results = asyncio.run(front_main(args))
    text = render(results, args)
    print(text)
    if not args.no_readme:
        rewrite_readme(text)


if __name__ == "__main__":
    main()
