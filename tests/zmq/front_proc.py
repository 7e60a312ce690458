"""A test front worker in its own process: opens ``argv[2]`` endless requests on the
engine at ``argv[1]`` and reads them; prints ``ready`` (with its incarnation) and
``submitted`` as JSON lines."""

from __future__ import annotations

import asyncio
import json
import sys

import tether
from tether_zmq import EngineClient


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def main(address: str, count: int) -> None:
    client = EngineClient(address, engine_timeout=1.0)
    registry = tether.Registry(on_abort=client.on_abort, max_pending=1_000_000)
    async with client.running(registry):
        async with asyncio.timeout(10):
            await client.wait_ready()
        say(ready=client.incarnation)
        streams = [client.open({"n": 0}) for _ in range(count)]
        say(submitted=[stream.rid for stream in streams])

        async def read(stream: tether.Stream) -> None:
            async for _ in stream:
                pass

        await asyncio.gather(*(read(stream) for stream in streams))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
