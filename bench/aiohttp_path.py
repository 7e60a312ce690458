"""One request on the aiohttp path, in process: the benchmark server's application
(:mod:`bench.servers.aiohttp_server`) on a loopback socket, and plain keep-alive
clients in the same process and loop, for :mod:`bench.instructions` to count.

``python -m bench.aiohttp_path VARIANT SECTION REQUESTS [--clients C] [--shape S]``
runs a tenth of ``REQUESTS`` as a warm-up, then ``REQUESTS`` requests of ``SECTION``
(``json``: one JSON body; ``stream``: 64 SSE events) spread over ``C`` connections,
against the server of ``VARIANT`` (``handoff``: issue 26's queue and future per
request; ``tether``). The clients are the same bytes-in, bytes-out loop for every
variant, so a difference of two counts is the server's.
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from .servers.aiohttp_server import build
from .servers.common import Backend, listen

__all__ = ["EVENTS", "main", "run"]

EVENTS = 64
"""Outputs per request: SSE events of a stream, folded into a JSON answer."""


async def _client(port: int, path: str, count: int) -> bytes:
    """``count`` GETs of ``path`` on one keep-alive connection, each read whole; the
    last one's body (a stream's de-chunked)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    body = b""
    try:
        for _ in range(count):
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            if b"transfer-encoding: chunked" in head:
                chunks = []
                while size := int((await reader.readline()).strip(), 16):
                    chunks.append((await reader.readexactly(size + 2))[:-2])
                await reader.readexactly(2)
                body = b"".join(chunks)
            else:
                length = head.split(b"content-length:")[1].split(b"\r\n")[0]
                body = await reader.readexactly(int(length))
    finally:
        writer.close()
    return body


async def run(variant: str, section: str, requests: int, clients: int, shape: str) -> list[bytes]:
    """Serve ``variant``'s application and run the warm-up, then ``requests``; the
    last body each client read."""
    runner = web.AppRunner(build(Backend(variant, 0.0)), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    sock = listen()
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    path = f"/{section}?n={EVENTS}&shape={shape}&json=orjson"
    try:
        for count in (requests // 10, requests):
            share = max(1, count // clients)
            bodies = await asyncio.gather(*(_client(port, path, share) for _ in range(clients)))
    finally:
        await runner.cleanup()
    return bodies


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("variant", choices=["handoff", "tether"])
    parser.add_argument("section", choices=["json", "stream"])
    parser.add_argument("requests", type=int)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--shape", choices=["step", "task", "thread"], default="step")
    args = parser.parse_args(argv)
    asyncio.run(run(args.variant, args.section, args.requests, args.clients, args.shape))


if __name__ == "__main__":
    main()
