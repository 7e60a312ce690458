"""A test front worker in its own process: opens ``argv[2]`` endless requests (rids
``argv[3]`` + index when given) on the engine at ``argv[1]`` and reads them; prints
``ready`` (with its incarnation), ``submitted``, ``outputs`` (the count so far, every
1000 outputs) and each request's ``failed``, as JSON lines, then stays up until killed."""

from __future__ import annotations

import asyncio
import json
import sys

import tether
from tether_zmq import EngineClient


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


received = [0]


async def read(stream: tether.Stream) -> None:
    try:
        async for _ in stream:
            received[0] += 1
            if received[0] % 1000 == 0:
                say(outputs=received[0])
    except tether.TetherError as exc:
        say(failed=stream.rid, error=type(exc.__cause__ or exc).__name__)


async def main(address: str, count: int, prefix: str | None) -> None:
    client = EngineClient(address, engine_timeout=1.0)
    registry = tether.Registry(on_abort=client.on_abort, max_pending=1_000_000)
    async with client.running(registry):
        async with asyncio.timeout(10):
            await client.wait_ready()
        say(ready=client.incarnation)
        rids = [None if prefix is None else f"{prefix}{i}" for i in range(count)]
        streams = [client.open({"n": 0}, rid=rid) for rid in rids]
        say(submitted=[stream.rid for stream in streams])
        readers = [asyncio.create_task(read(stream)) for stream in streams]
        try:
            await asyncio.Event().wait()
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


if __name__ == "__main__":
    prefix = sys.argv[3] if len(sys.argv) > 3 else None
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), prefix))
