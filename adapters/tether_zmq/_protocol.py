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
    "MAX_FAILURE_TEXT",
    "MAX_FIELDS",
    "MIN_MESSAGE",
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
    "ToEngine",
    "ToFront",
    "TooManyEntries",
    "Welcome",
    "clip",
    "decode",
    "decode_at_engine",
    "decode_at_front",
    "encode",
    "entries_of",
]

PROTOCOL_VERSION: Final = 2
"""Bumped on any incompatible change; a mismatch is refused at the handshake."""
MAX_ENTRIES: Final = 4096
"""Entries per message, at most: submissions per ``Submit`` and per ``Abort``, outputs
and failures together per ``Step``. What one message costs a loop is bounded by this,
not only by its bytes (a frame of millions of tiny entries would take seconds to
decode and route)."""

MAX_FIELDS: Final = 16
"""Fields of one message's array, at most, its tag included (the longest message has
six). A decoder skips fields past its own, one by one, to leave a newer peer room: a
frame of millions of them would hold the loop as long as one of millions of entries,
so it is refused unread."""

MAX_FAILURE_TEXT: Final = 1024
"""Bytes of a failure's message, at most (UTF-8, cut at a character boundary): the
engine cuts what it sends, the front what it shows a client (an engine is not trusted
to have cut it)."""

MIN_MESSAGE: Final = 1024
"""Bytes of frame cap below which a hello or a welcome is refused: no step, not even a
failure's message, would fit (every request of that session would fail, unexplained)."""


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
ToEngine = Hello | Submit | Abort | Ping | Pong
ToFront = Welcome | Refuse | Step | Ping | Pong


class _StepFrame(msgspec.Struct, tag=6, array_like=True, frozen=True):
    """A ``Step`` as the front first reads it: its two lists skipped unbuilt, so that
    their lengths are checked before a single entry becomes an object."""

    seq: int
    outputs: msgspec.Raw
    failures: msgspec.Raw


class TooManyEntries(ValueError):
    """A message holds more than :data:`MAX_ENTRIES` entries: refused unread."""

    def __init__(self, count: int) -> None:
        super().__init__(f"a message of {count} entries (at most {MAX_ENTRIES})")
        self.count = count


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
# Each end decodes only what may be sent to it: a frame tagged for the other direction
# fails on its tag, before the rest is read (a hostile peer's ``Step`` of millions of
# entries sent to the engine would otherwise be built in full, then dropped).
_engine_decoder: msgspec.msgpack.Decoder[ToEngine] = msgspec.msgpack.Decoder(ToEngine)
_front_decoder: msgspec.msgpack.Decoder[Welcome | Refuse | _StepFrame | Ping | Pong]
_front_decoder = msgspec.msgpack.Decoder(Welcome | Refuse | _StepFrame | Ping | Pong)
_outputs_decoder = msgspec.msgpack.Decoder(list[tuple[int, bytes, bool]])
_failures_decoder = msgspec.msgpack.Decoder(list[tuple[int, str, int]])


def clip(text: str, limit: int) -> str:
    """``text`` as UTF-8 that fits ``limit`` bytes, cut at a character boundary; a lone
    surrogate (which no UTF-8 encoder takes) becomes ``?``."""
    # (no character is less than a byte: the first ``limit`` characters are enough,
    # so a huge text costs no more than a short one)
    return text[:limit].encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


_INT_WIDTH: Final = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
"""Bytes of a MessagePack integer by its first byte (header included), beyond fixints."""
_ARRAY_WIDTH: Final = {0xDC: 3, 0xDD: 5}
"""Bytes of a MessagePack array header by its first byte, beyond fixarrays."""


def _array_at(data: bytes | memoryview, at: int) -> tuple[int, int]:
    """The length and header width of the array whose header starts at ``at``, in any
    encoding MessagePack allows; ``(-1, 0)`` if there is none."""
    code = data[at] if at < len(data) else -1
    if 0x90 <= code <= 0x9F:
        return code - 0x90, 1
    width = _ARRAY_WIDTH.get(code, 0)
    if not width or at + width > len(data):
        return -1, 0
    return int.from_bytes(data[at + 1 : at + width], "big"), width


def _int_at(data: bytes | memoryview, at: int) -> tuple[int, int]:
    """The value and width of the integer at ``at``, in any encoding; width 0 if none."""
    code = data[at] if at < len(data) else -1
    if 0 <= code <= 0x7F or code >= 0xE0:
        return (code if code <= 0x7F else code - 0x100), 1
    width = _INT_WIDTH.get(code, 0)
    if not width or at + width > len(data):
        return 0, 0
    return int.from_bytes(data[at + 1 : at + width], "big", signed=code >= 0xD0), width


_COUNTED_TAGS: Final = (4, 5)  # (Submit, Abort)


def entries_of(frame: bytes | memoryview) -> int:
    """How many entries the list of a ``Submit`` or ``Abort`` frame holds, read from
    its MessagePack headers without decoding it; -1 for any other frame (or one too
    broken to tell: the decoder then fails on its first wrong element).

    Headers are read in every encoding MessagePack allows, not only the canonical one
    (a 3-array as ``array16``, a negative ``seq``, a tag as ``int8``): the decoder takes
    them all, so a peer could otherwise slip a frame of millions of entries past this.
    """
    length, at = _array_at(frame, 0)
    if length < 3:  # (the decoder ignores extra trailing fields of an array-like struct)
        return -1
    tag, width = _int_at(frame, at)
    if not width or tag not in _COUNTED_TAGS:
        return -1
    _, seq_width = _int_at(frame, at + width)
    if not seq_width:
        return -1
    return _array_at(frame, at + width + seq_width)[0]


def encode(message: Message) -> bytes:
    """One message as the bytes of one frame."""
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """The message in ``frame``, whichever direction it goes (for tests and tools).

    :raises msgspec.DecodeError: the frame is not a message of this protocol
        (malformed, truncated, an unknown tag, a field of the wrong type).
    """
    return _decoder.decode(frame)


def _check_fields(frame: bytes | memoryview) -> None:
    fields = _array_at(frame, 0)[0]
    if fields > MAX_FIELDS:
        raise msgspec.DecodeError(f"a message of {fields} fields (at most {MAX_FIELDS})")


def decode_at_engine(frame: bytes | memoryview) -> ToEngine:
    """A message a front may send; anything else fails on its tag, unread.

    :raises msgspec.DecodeError: the frame is no front-to-engine message, or one of
        more than :data:`MAX_FIELDS` fields.
    """
    _check_fields(frame)
    return _engine_decoder.decode(frame)


def decode_at_front(frame: bytes | memoryview) -> ToFront:
    """A message an engine may send; anything else fails on its tag, unread. A
    ``Step``'s lists are measured before they are built.

    :raises msgspec.DecodeError: the frame is no engine-to-front message, or one of
        more than :data:`MAX_FIELDS` fields.
    :raises TooManyEntries: a ``Step`` of more than :data:`MAX_ENTRIES` entries.
    """
    _check_fields(frame)
    message = _front_decoder.decode(frame)
    if not isinstance(message, _StepFrame):
        return message
    outputs, failures = memoryview(message.outputs), memoryview(message.failures)
    count = max(0, _array_at(outputs, 0)[0]) + max(0, _array_at(failures, 0)[0])
    if count > MAX_ENTRIES:
        raise TooManyEntries(count)
    return Step(message.seq, _outputs_decoder.decode(outputs), _failures_decoder.decode(failures))


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
    a process that can reach the socket could otherwise run anything.

    :param decodes: the type of what this end receives (the engine: a request; a
        front: an output), as msgspec takes it (a ``Struct``, ``dict[str, str | int]``).
        Without it anything decodes, and what a payload costs to decode is bounded only
        by its bytes: a 4 MiB payload of empty lists holds the loop for about a second.
        With it a payload of another shape is refused at its first wrong element, so
        an engine that any peer can reach should say what a request is.
    """

    __slots__ = ("_decoder", "_encoder")

    def __init__(self, decodes: Any = Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decodes)

    def encode(self, obj: Any, /) -> bytes:
        return self._encoder.encode(obj)

    def decode(self, data: bytes, /) -> Any:
        return self._decoder.decode(data)
