"""What the fault and admission tests do as clients: streams read event by event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The ``data:`` payloads of a server-sent event stream, decoded; ``"[DONE]"`` as is."""
    async for line in response.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield "[DONE]" if data == b"[DONE]" else json.loads(data)


async def outcome(
    session: aiohttp.ClientSession, body: dict[str, Any], *, base: str = ""
) -> tuple[int, list[Any]]:
    """POST ``body`` to ``{base}/generate`` and read the answer to its end: the status
    and the stream's events (or the one JSON body, as a list of one)."""
    async with session.post(f"{base}/generate", json=body) as response:
        if body.get("stream") and response.status == 200:
            return response.status, [event async for event in events(response)]
        return response.status, [await response.json()]


def long_stream(prompt: str, **fields: Any) -> dict[str, Any]:
    """A streamed request that only an abort, a failure or shutdown can end in time."""
    return {"text": prompt, "max_tokens": 4000, "stream": True, **fields}


def http_post(path: str, body: dict[str, Any]) -> bytes:
    """A bare HTTP/1.1 POST of ``body`` as JSON."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def sse_payloads(stream: bytes) -> list[Any]:
    """The decoded ``data:`` payloads of a raw chunked HTTP response holding an SSE stream.

    Chunk-size lines fall between events (each write holds whole events), and
    lines that are not ``data:`` (sizes, headers, pings) are skipped.
    """
    found: list[Any] = []
    for line in stream.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            found.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return found
