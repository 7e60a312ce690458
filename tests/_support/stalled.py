"""A client that sends a request and then never reads: its socket stalls the server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Final

RECEIVE_BUFFER: Final = 4096
"""The stalled client's receive buffer, in bytes: the kernel window stays tiny."""


@contextlib.asynccontextmanager
async def stalled_client(port: int, request: bytes) -> AsyncIterator[socket.socket]:
    """Connect to 127.0.0.1:``port`` with a small receive buffer, send ``request``,
    and read nothing until the block ends; then close the socket."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Set before connecting, so that the advertised window is small from the start.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request)
        yield sock
    finally:
        sock.close()


def http_get(target: str) -> bytes:
    """A bare HTTP/1.1 GET for ``target``."""
    return f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
