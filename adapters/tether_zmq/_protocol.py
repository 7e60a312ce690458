"""The wire protocol between front workers and an engine: one frame, one msgspec struct.

Every message is a single ZeroMQ frame holding one MessagePack-encoded struct from
the union :data:`Message` (the ROUTER adds the front's identity frame in front of
it on the engine side). Each struct is tagged and encoded as an array, so a frame
costs a few bytes of framing beyond its payloads. Payloads (a submission's request,
an output) are opaque ``bytes`` encoded by a :class:`Codec` the application picks:
MessagePack by default, never pickle, so a peer can at worst send data, not code.

Every message carries ``seq``, counted per direction and per session from 0 (the
``Hello`` and the ``Welcome``). A gap means a message was lost or corrupted on the
link: the receiver treats it as a link failure, never as something to paper over.

Every submission carries its own *submission id*, drawn by the front from one counter
that only grows for the life of the front: aborts and outputs name the submission,
not the rid, so a rid reused after an abort (even in the same loop tick) is a new
submission that no message about the old one can reach. Both ends announce the
largest frame they accept (``max_message``): each side sends no more than the
other accepts and checks it, in bytes, before sending.

=========  =========  ===============================================================
message    direction  meaning
=========  =========  ===============================================================
Hello      F → E      open a session: version, front incarnation, attempt, frame cap
Welcome    E → F      session accepted: version, engine incarnation, attempt, frame cap
Refuse     E → F      hello refused (version mismatch) or session unknown: say hello
Submit     F → E      ``(submission, rid, payload)``: one request or a whole batch
Abort      F → E      submissions the front no longer wants (client gone, deadline)
Step       E → F      one engine step's outputs ``(submission, payload, finished)``
                      and failures ``(submission, message, status)`` for this front
Ping       both       liveness probe, answered by ``Pong`` from the peer's event loop
Pong       both       answer to ``Ping``, echoing its ``sent`` time
=========  =========  ===============================================================
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import msgspec

__all__ = [
    "MAX_ENTRIES",
    "PROTOCOL_VERSION",
    "Abort",
    "Codec",
    "Hello",
    "Message",
    "MsgpackCodec",
    "Ping",
    "Pong",
    "Refuse",
    "Step",
    "Submit",
    "Welcome",
    "clip",
    "decode",
    "encode",
    "entries_of",
]

PROTOCOL_VERSION: Final = 2
"""Bumped on any incompatible change; a mismatch is refused at the handshake."""
MAX_ENTRIES: Final = 4096
"""Submissions per ``Submit`` and per ``Abort`` message, at most: what one message
costs the engine's loop is bounded by this, not only by its bytes (a frame of
millions of tiny entries would take seconds to decode and admit)."""


class Hello(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """A front opens a session. ``attempt`` lets it tell a stale ``Welcome`` from the
    answer to its latest hello; ``max_message`` is the largest frame it accepts."""

    seq: int
    version: int
    front: str
    attempt: int
    max_message: int


class Welcome(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """The engine accepts a session; every request of a former session of this
    front has been aborted before this is sent. ``max_message`` is the largest frame
    the engine accepts: the front refuses a larger submission itself (413)."""

    seq: int
    version: int
    engine: str
    attempt: int
    max_message: int


class Refuse(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """The engine refuses a hello (``version`` is the engine's) or a message from a
    front it has no session with (it must say hello again)."""

    seq: int
    version: int
    reason: str


class Submit(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """New requests: ``(submission, rid, payload)``; submission ids only grow."""

    seq: int
    requests: list[tuple[int, str, bytes]]


class Abort(msgspec.Struct, tag=5, array_like=True, frozen=True):
    """Submissions the front closed before they finished."""

    seq: int
    submissions: list[int]


class Step(msgspec.Struct, tag=6, array_like=True, frozen=True):
    """One engine step for one front: outputs in order, then failures, by submission."""

    seq: int
    outputs: list[tuple[int, bytes, bool]]
    failures: list[tuple[int, str, int]]


class Ping(msgspec.Struct, tag=7, array_like=True, frozen=True):
    """A liveness probe; ``sent`` is the sender's monotonic clock."""

    seq: int
    sent: float


class Pong(msgspec.Struct, tag=8, array_like=True, frozen=True):
    """The answer to a :class:`Ping`, echoing its ``sent``."""

    seq: int
    sent: float


Message = Hello | Welcome | Refuse | Submit | Abort | Step | Ping | Pong

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def clip(text: str, limit: int) -> str:
    """``text`` as UTF-8 that fits ``limit`` bytes, cut at a character boundary; a lone
    surrogate (which no UTF-8 encoder takes) becomes ``?``."""
    # (no character is less than a byte: the first ``limit`` characters are enough,
    # so a huge text costs no more than a short one)
    return text[:limit].encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


_SUBMIT_OR_ABORT: Final = (b"\x93\x04", b"\x93\x05")  # (a 3-array, tag 4 or 5)


def entries_of(frame: bytes) -> int:
    """How many entries the list of a ``Submit`` or ``Abort`` frame holds, read from
    its MessagePack headers without decoding it; -1 for any other frame (or one too
    broken to tell: the full decode then refuses it)."""
    if frame[:2] not in _SUBMIT_OR_ABORT:
        return -1
    at = 2
    head = frame[at : at + 1]
    if not head:
        return -1
    # seq: a positive fixint, or uint 8/16/32/64
    code = head[0]
    at += 1 if code < 0x80 else {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}.get(code, 0)
    if at == 2:
        return -1
    head = frame[at : at + 5]
    if not head:
        return -1
    code = head[0]
    if 0x90 <= code <= 0x9F:
        return code - 0x90
    if code == 0xDC and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if code == 0xDD and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return -1


def encode(message: Message) -> bytes:
    """One message as the bytes of one frame."""
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """The message in ``frame``.

    :raises msgspec.DecodeError: the frame is not a message of this protocol
        (malformed, truncated, an unknown tag, a field of the wrong type).
    """
    return _decoder.decode(frame)


class Codec(Protocol):
    """How payloads become bytes and back; both sides of a link use the same codec."""

    def encode(self, obj: Any, /) -> bytes:
        """``obj`` as bytes."""
        ...

    def decode(self, data: bytes, /) -> Any:
        """The object ``data`` holds; raises on data it cannot decode."""
        ...


class MsgpackCodec:
    """The default codec: MessagePack through msgspec (dicts, lists, strings, numbers,
    bytes, ``None``). It decodes data, never code: pickle is not a default here, since
    a process that can reach the socket could otherwise run anything."""

    __slots__ = ("_decoder", "_encoder")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()

    def encode(self, obj: Any, /) -> bytes:
        return self._encoder.encode(obj)

    def decode(self, data: bytes, /) -> Any:
        return self._decoder.decode(data)
