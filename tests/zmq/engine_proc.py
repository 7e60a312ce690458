"""A test engine in its own process, serving the link on the address in ``argv[1]``.

Every running request gets one output per step (``{"i": n}``, from 1) until its
``"n"`` outputs (``"n": 0``: endless). It prints one JSON line per event: ``ready``
(with the bound address) first, then each ``submit`` and ``cancel`` (with the
front and the reason), so that a test in another process can count them.
"""

from __future__ import annotations

import asyncio
import json
import sys

from tether_zmq import Cancellation, EngineServer, RequestKey, Submission


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def produce(server: EngineServer, jobs: dict[RequestKey, list[int]], step: float) -> None:
    while True:
        await asyncio.sleep(step)
        outputs = []
        for key, job in list(jobs.items()):
            job[0] += 1
            finished = 0 < job[1] <= job[0]
            outputs.append((key, {"i": job[0]}, finished))
            if finished:
                del jobs[key]
        if outputs:
            server.send(outputs)


async def main(address: str, peer_timeout: float, step: float) -> None:
    jobs: dict[RequestKey, list[int]] = {}
    async with EngineServer(address, peer_timeout=peer_timeout) as server:
        say(ready=server.address, incarnation=server.incarnation)
        producer = asyncio.create_task(produce(server, jobs, step))
        try:
            while True:
                for event in await server.receive():
                    front = event.key.front.decode()
                    if isinstance(event, Submission):
                        jobs[event.key] = [0, int(event.request["n"])]
                        say(submit=event.key.rid, front=front)
                    elif isinstance(event, Cancellation):
                        jobs.pop(event.key, None)
                        say(cancel=event.key.rid, front=front, reason=event.reason)
        finally:
            producer.cancel()
            try:
                await producer
            except asyncio.CancelledError:
                pass


if __name__ == "__main__":
    peer_timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    step = float(sys.argv[3]) if len(sys.argv) > 3 else 0.002
    try:
        asyncio.run(main(sys.argv[1], peer_timeout, step))
    except KeyboardInterrupt:
        pass
