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
Refuse     E → F      hello refused (version, too large) or session unknown: say hello
Submit     F → E      ``(submission, rid, payload)``: one request or a whole batch
Abort      F → E      submissions the front no longer wants (client gone, deadline)
Step       E → F      one engine step's outputs ``(submission, payload, finished)``
                      and failures ``(submission, message, status)`` for this front
Ping       both       liveness probe, answered by ``Pong`` from the peer's event loop
Pong       both       answer to ``Ping``, echoing its ``sent`` time
=========  =========  ===============================================================
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Annotated, Any, Final, Protocol

import msgspec
import msgspec.structs

__all__ = [
    "HELLO_TOO_LARGE",
    "MAX_ENTRIES",
    "MAX_FAILURE_TEXT",
    "MAX_FIELDS",
    "MAX_NAME",
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
    "tag_of",
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
six). The fields past a message's own leave a newer peer room; each must be a scalar
(nil, a bool, a number, a string). msgspec skips what it does not know element by
element, so a frame of millions of fields, or one field holding millions of elements,
would hold the loop as long as one of millions of entries: either is refused at its
header."""

MAX_FAILURE_TEXT: Final = 1024
"""Bytes of a failure's message, at most (UTF-8, cut at a character boundary): the
engine cuts what it sends, the front what it shows a client (an engine is not trusted
to have cut it)."""

MAX_NAME: Final = 128
"""Bytes of an end's name (its incarnation), at most: the engine refuses a hello that
names its front with more, a front keeps no more of a welcome's engine name (a name is
for logs; a longer one would be kept, four times its bytes, for the whole session)."""

HELLO_TOO_LARGE: Final = "hello too large"
"""How the reason of a ``Refuse`` that answers a hello too large to be read begins: the
front stops taking requests and says why (saying the same hello again cannot help)."""

MIN_MESSAGE: Final = 1024
"""Bytes of frame cap below which a hello or a welcome is refused: no step, not even a
failure's message, would fit (every request of that session would fail, unexplained)."""


# A Step's lists are measured from their headers: more than MAX_ENTRIES in either is
# refused before it is built or walked, and decode_at_front then tells how many there
# were (the engine reads a Submit's or an Abort's count itself, with entries_of, to end
# that session).
_Outputs = Annotated[list[tuple[int, bytes, bool]], msgspec.Meta(max_length=MAX_ENTRIES)]
_Failures = Annotated[list[tuple[int, str, int]], msgspec.Meta(max_length=MAX_ENTRIES)]

# Every message is read with ``forbid_unknown_fields``; msgspec refuses an array of
# fewer fields than a message's own at its header, but one of more only after reading
# every field it knows. So _Reader reads the outer array's header itself and sends a
# frame of a few more fields (a newer peer's) straight to the message's twin below.


class Hello(msgspec.Struct, tag=1, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A front opens a session. ``attempt`` lets it tell a stale ``Welcome`` from the
    answer to its latest hello; ``max_message`` is the largest frame it accepts."""

    seq: int
    version: int
    front: str
    attempt: int
    max_message: int


class Welcome(msgspec.Struct, tag=2, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The engine accepts a session; every request of a former session of this
    front has been aborted before this is sent. ``max_message`` is the largest frame
    the engine accepts: the front refuses a larger submission itself (413)."""

    seq: int
    version: int
    engine: str
    attempt: int
    max_message: int


class Refuse(msgspec.Struct, tag=3, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The engine refuses a hello (``version`` is the engine's) or a message from a
    front it has no session with (it must say hello again)."""

    seq: int
    version: int
    reason: str


class Submit(msgspec.Struct, tag=4, array_like=True, frozen=True, forbid_unknown_fields=True):
    """New requests: ``(submission, rid, payload)``; submission ids only grow."""

    seq: int
    requests: list[tuple[int, str, bytes]]


class Abort(msgspec.Struct, tag=5, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Submissions the front closed before they finished."""

    seq: int
    submissions: list[int]


class Step(msgspec.Struct, tag=6, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One engine step for one front: outputs in order, then failures, by submission."""

    seq: int
    outputs: _Outputs
    failures: _Failures


class Ping(msgspec.Struct, tag=7, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A liveness probe; ``sent`` is the sender's monotonic clock."""

    seq: int
    sent: float


class Pong(msgspec.Struct, tag=8, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The answer to a :class:`Ping`, echoing its ``sent``."""

    seq: int
    sent: float


Message = Hello | Welcome | Refuse | Submit | Abort | Step | Ping | Pong
ToEngine = Hello | Submit | Abort | Ping | Pong
ToFront = Welcome | Refuse | Step | Ping | Pong


class TooManyEntries(ValueError):
    """A message holds more than :data:`MAX_ENTRIES` entries: refused unread."""

    def __init__(self, count: int) -> None:
        super().__init__(f"a message of {count} entries (at most {MAX_ENTRIES})")
        self.count = count


_Extra = bool | int | float | str | None
"""What a field past a message's own may be: a scalar, which costs its own bytes to
read. A container there would be skipped element by element, whatever its size."""


def _twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``cls`` with room for a newer peer: scalar fields up to :data:`MAX_FIELDS`."""
    own: list[tuple[str, Any, Any]] = [
        (field.name, field.type, msgspec.NODEFAULT) for field in msgspec.structs.fields(cls)
    ]
    extras = [(f"extra{i}", _Extra, None) for i in range(len(own) + 1, MAX_FIELDS)]
    return msgspec.defstruct(
        f"_{cls.__name__}Twin",
        own + extras,
        tag=cls.__struct_config__.tag,
        array_like=True,
        frozen=True,
        forbid_unknown_fields=True,
    )


_TWINS: Final[dict[type[msgspec.Struct], type[msgspec.Struct]]] = {
    cls: _twin(cls) for cls in (Hello, Welcome, Refuse, Submit, Abort, Step, Ping, Pong)
}
_OWN: Final = {twin: (cls, len(msgspec.structs.fields(cls))) for cls, twin in _TWINS.items()}
"""What each twin is read as: its message, and how many of its fields are the message's."""


class _Reader:
    """Decodes one union of messages, once: a frame's outer array header says how many
    fields it holds, so a frame of exactly its message's fields (every frame of a peer
    of this version) is read strictly, one of a few more (a newer peer's) straight with
    that message's twin, and one of more than :data:`MAX_FIELDS` not at all. msgspec
    checks an array-like struct's *maximum* length only after reading every field it
    knows, so trying strictly first would read a newer peer's frame twice; a frame that
    fails on a field's type is refused as it failed, never read again."""

    __slots__ = ("_own", "_plain", "_strict", "_twins")

    def __init__(self, *messages: type[msgspec.Struct]) -> None:
        self._strict: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(_union(messages))
        self._twins: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
            _union([_TWINS[cls] for cls in messages])
        )
        # tag -> the fields of that message's array, its tag included
        self._own: dict[int, int] = {
            cls.__struct_config__.tag: len(msgspec.structs.fields(cls)) + 1  # type: ignore[misc]
            for cls in messages
        }
        # By a frame's second byte (its tag, when it opens a fixarray), the largest first
        # byte the strict decoder is enough for: a fixarray of at most that message's
        # fields, or of any length with an unknown tag (it fails on it). Any other header
        # (an array16 or 32, whose second byte is no tag) is parsed. One lookup, honestly.
        self._plain: tuple[int, ...] = tuple(
            0x90 + self._own.get(code, 15) if code <= 0x7F else -1 for code in range(256)
        )

    def decode(self, frame: bytes | memoryview) -> Any:
        try:
            plain = frame[0] <= self._plain[frame[1]]
        except IndexError:  # (shorter than any message: it fails at once)
            plain = True
        if plain:
            return self._strict.decode(frame)
        length, tag = _head(frame)
        own = self._own.get(tag)
        if own is None or length <= own:  # (an unknown tag fails on it, a short array at
            return self._strict.decode(frame)  # its header: both unread)
        if length > MAX_FIELDS:
            raise msgspec.ValidationError(
                f"Expected `array` of at most length {MAX_FIELDS}, got {length}"
            )
        twin = self._twins.decode(frame)
        cls, fields = _OWN[type(twin)]
        return cls(*msgspec.structs.astuple(twin)[:fields])


def _union(members: Iterable[type[msgspec.Struct]]) -> Any:
    return functools.reduce(operator.or_, members)


_encoder = msgspec.msgpack.Encoder()
_reader = _Reader(Hello, Welcome, Refuse, Submit, Abort, Step, Ping, Pong)
# Each end decodes only what may be sent to it: a frame tagged for the other direction
# fails on its tag, before the rest is read (a hostile peer's ``Step`` of millions of
# entries sent to the engine would otherwise be built in full, then dropped).
_engine_reader = _Reader(Hello, Submit, Abort, Ping, Pong)
_front_reader = _Reader(Welcome, Refuse, Step, Ping, Pong)


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


_SCALAR_WIDTH: Final = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, **_INT_WIDTH}
"""Bytes of a MessagePack nil, bool, float or integer by its first byte, beyond fixints."""
_SIZED: Final = {0xC4: 2, 0xC5: 3, 0xC6: 5, 0xD9: 2, 0xDA: 3, 0xDB: 5}
"""Header bytes of a MessagePack bin or str by its first byte, beyond fixstrs; its size
follows the first byte."""


def _head(frame: bytes | memoryview) -> tuple[int, int]:
    """The length of a frame's outer array and the tag that opens it, from their headers
    alone, in any encoding MessagePack allows; ``(-1, -1)`` if there is none to read."""
    length, width = _array_at(frame, 0)
    if not width:
        return -1, -1
    tag, tag_width = _int_at(frame, width)
    return (length, tag) if tag_width else (-1, -1)


def _skip_scalar(data: bytes | memoryview, at: int) -> int:
    """Where the scalar (nil, bool, number, bin, str) at ``at`` ends; -1 if it is none."""
    code = data[at] if at < len(data) else -1
    if 0 <= code <= 0x7F or code >= 0xE0:
        end = at + 1
    elif 0xA0 <= code <= 0xBF:
        end = at + 1 + code - 0xA0
    elif code in _SCALAR_WIDTH:
        end = at + _SCALAR_WIDTH[code]
    elif code in _SIZED:
        width = _SIZED[code]
        end = at + width + int.from_bytes(data[at + 1 : at + width], "big")
    else:
        return -1
    return end if end <= len(data) else -1


_COUNTED_TAGS: Final = (4, 5)  # (Submit, Abort)
_STEP_TAG: Final = 6
_STEP_ENTRY: Final = 3  # (submission, payload, finished) and (submission, message, status)


def _first_list(frame: bytes | memoryview) -> tuple[int, int, int]:
    """The tag of the message in ``frame`` and the length of the list after its
    ``seq``, with where that list's header ends; read from headers alone, ``(-1, -1,
    0)`` if there is none to read."""
    length, at = _array_at(frame, 0)
    if length < 3:  # (no list: the tag and seq come first)
        return -1, -1, 0
    tag, width = _int_at(frame, at)
    if not width:
        return -1, -1, 0
    _, seq_width = _int_at(frame, at + width)
    if not seq_width:
        return -1, -1, 0
    at += width + seq_width
    count, width = _array_at(frame, at)
    return tag, count, at + width


def _step_entries(frame: bytes | memoryview) -> int:
    """How many entries a ``Step`` frame holds, outputs and failures together, from their
    headers: the outputs' header first, then (when they are few enough to be walked) the
    failures' header past them; -1 for any other frame, or one too broken to tell."""
    tag, outputs, at = _first_list(frame)
    if tag != _STEP_TAG or outputs < 0:
        return -1
    if outputs > MAX_ENTRIES:
        return outputs  # (the failures' header lies past them: not walked)
    for _ in range(outputs):  # (at most MAX_ENTRIES entries of three scalars each)
        fields, width = _array_at(frame, at)
        if fields != _STEP_ENTRY:
            return -1
        at += width
        for _ in range(_STEP_ENTRY):
            at = _skip_scalar(frame, at)
            if at < 0:
                return -1
    failures, _ = _array_at(frame, at)
    return -1 if failures < 0 else outputs + failures


def tag_of(frame: bytes | memoryview) -> int:
    """The tag of the message in ``frame``, read from its headers alone; -1 if none."""
    return _head(frame)[1]


def entries_of(frame: bytes | memoryview) -> int:
    """How many entries the list of a ``Submit`` or ``Abort`` frame holds, read from
    its MessagePack headers without decoding it; -1 for any other frame (or one too
    broken to tell: the decoder then fails on its first wrong element).

    Headers are read in every encoding MessagePack allows, not only the canonical one
    (a 3-array as ``array16``, a negative ``seq``, a tag as ``int8``): the decoder takes
    them all, so a peer could otherwise slip a frame of millions of entries past this.
    """
    tag, count, _ = _first_list(frame)
    return count if tag in _COUNTED_TAGS else -1


def encode(message: Message) -> bytes:
    """One message as the bytes of one frame."""
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """The message in ``frame``, whichever direction it goes (for tests and tools).

    :raises msgspec.DecodeError: the frame is not a message of this protocol
        (malformed, truncated, an unknown tag, a field of the wrong type, more than
        :data:`MAX_FIELDS` fields, a field past its own that is not a scalar, a
        ``Step``'s list of more than :data:`MAX_ENTRIES` entries).
    """
    message: Message = _reader.decode(frame)
    return message


def decode_at_engine(frame: bytes | memoryview) -> ToEngine:
    """A message a front may send; anything else fails on its tag, unread.

    :raises msgspec.DecodeError: the frame is no front-to-engine message, or one of
        more than :data:`MAX_FIELDS` fields, or a field past its own that is not a
        scalar.
    """
    message: ToEngine = _engine_reader.decode(frame)
    return message


def decode_at_front(frame: bytes | memoryview, *, measure: bool = True) -> ToFront:
    """A message an engine may send; anything else fails on its tag, unread. A
    ``Step``'s lists are measured from their headers before they are built.

    ``measure=False`` (a front with no session, which has none to end) never walks a
    ``Step``'s headers: a list past :data:`MAX_ENTRIES` fails at its header as a
    :class:`msgspec.ValidationError`, for one decode, whatever the engine sends.

    :raises msgspec.DecodeError: the frame is no engine-to-front message, or one of
        more than :data:`MAX_FIELDS` fields, or a field past its own that is not a
        scalar.
    :raises TooManyEntries: a ``Step`` of more than :data:`MAX_ENTRIES` entries, outputs
        and failures together (either list past it is refused at its header, unbuilt).
    """
    try:
        message: ToFront = _front_reader.decode(frame)
    except msgspec.ValidationError as exc:
        # A list past MAX_ENTRIES fails at its header, unread, and msgspec says so, not by
        # how much: only then are the headers walked to tell (the failures' lies past at
        # most MAX_ENTRIES outputs, a few ms of walking, once, as the session ends; a
        # front with no session asks for no walk). A frame that failed on anything else
        # is not walked: it costs one decode.
        if measure and "of length <=" in str(exc):
            count = _step_entries(frame)
            if count > MAX_ENTRIES:
                raise TooManyEntries(count) from None
        raise
    if isinstance(message, Step) and len(message.outputs) + len(message.failures) > MAX_ENTRIES:
        raise TooManyEntries(len(message.outputs) + len(message.failures))
    return message


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
        an engine that any peer can reach should say what a request is. A ``Struct``
        should say ``forbid_unknown_fields=True`` as well: msgspec skips a field it
        does not know element by element (3-4 ms per MiB), and refuses a forbidden
        one at its name.
    """

    __slots__ = ("_decoder", "_encoder")

    def __init__(self, decodes: Any = Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decodes)

    def encode(self, obj: Any, /) -> bytes:
        return self._encoder.encode(obj)

    def decode(self, data: bytes, /) -> Any:
        return self._decoder.decode(data)
