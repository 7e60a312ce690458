"""Wire framing shared by every adapter: SSE and NDJSON encoders.

Encoders are pure functions of outputs to bytes. A batch's outputs carry their
``index``: a dict output gets an ``"index"`` key first, any other output is
wrapped as ``{"index": i, "output": value}``. JSON goes through orjson when it
is installed, else the standard library (compact, UTF-8), and can be replaced
with ``dumps=``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, ClassVar, Final

from .types import Dumps

__all__ = ["NDJSON", "SSE", "Encoder", "default_dumps"]


def _stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _pick_dumps() -> Dumps:
    try:
        import orjson
    except ImportError:
        return _stdlib_dumps
    return orjson.dumps


default_dumps: Final[Dumps] = _pick_dumps()
"""The JSON serialiser tether uses unless told otherwise: orjson if installed."""


def with_index(index: int, output: Any) -> Any:
    """A batch output as written on the wire: tagged with its sub-request's index."""
    if isinstance(output, dict):
        return {"index": index, **output}
    return {"index": index, "output": output}


class Encoder:
    """Base of the streaming encoders: frames outputs, errors, pings and the end.

    :param dumps: serialises one JSON value to bytes.
    """

    media_type: ClassVar[str] = "application/octet-stream"
    headers: ClassVar[dict[str, str]] = {}

    __slots__ = ("dumps",)

    def __init__(self, *, dumps: Dumps | None = None) -> None:
        self.dumps: Dumps = dumps or default_dumps

    def frame(self, payload: bytes) -> bytes:
        """Wrap one serialised JSON value into a frame."""
        raise NotImplementedError

    def encode(self, output: Any) -> bytes:
        """One output as one frame."""
        return self.frame(self.dumps(output))

    def encode_many(self, outputs: Iterable[Any]) -> bytes:
        """Several outputs as consecutive frames, for one write."""
        frame, dumps = self.frame, self.dumps
        return b"".join([frame(dumps(output)) for output in outputs])

    def encode_indexed(self, pairs: Iterable[tuple[int, Any]]) -> bytes:
        """Several ``(index, output)`` pairs of a batch as consecutive frames."""
        frame, dumps = self.frame, self.dumps
        return b"".join([frame(dumps(with_index(index, output))) for index, output in pairs])

    def error(self, body: dict[str, Any]) -> bytes:
        """An error event (``body`` is ``{"error": {...}}``, see ``tether.error_body``)."""
        return self.frame(self.dumps(body))

    def terminal(self) -> bytes:
        """The frame that ends a stream; ``b""`` when the format has none."""
        return b""

    def ping(self) -> bytes:
        """A keep-alive that clients ignore."""
        raise NotImplementedError


class SSE(Encoder):
    """Server-sent events: ``data: <json>\\n\\n``, ending with ``data: [DONE]\\n\\n``,
    pinging with a ``: ping`` comment."""

    media_type: ClassVar[str] = "text/event-stream"
    headers: ClassVar[dict[str, str]] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    __slots__ = ()

    def frame(self, payload: bytes) -> bytes:
        return b"data: " + payload + b"\n\n"

    def terminal(self) -> bytes:
        return b"data: [DONE]\n\n"

    def ping(self) -> bytes:
        return b": ping\n\n"


class NDJSON(Encoder):
    """Newline-delimited JSON: one value per line; pings are empty lines, which
    NDJSON readers skip; no terminal frame (the end of the body ends the stream)."""

    media_type: ClassVar[str] = "application/x-ndjson"
    headers: ClassVar[dict[str, str]] = {"Cache-Control": "no-cache"}

    __slots__ = ()

    def frame(self, payload: bytes) -> bytes:
        return payload + b"\n"

    def ping(self) -> bytes:
        return b"\n"
