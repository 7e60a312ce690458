"""Wire framing shared by every adapter: SSE and NDJSON encoders.

Encoders are pure functions of outputs to bytes. A batch's outputs are written
in one envelope, ``{"index": i, "output": value}``, so that no field of an output
can overwrite its sub-request's index. JSON goes through orjson when it is
installed, else the standard library (compact, UTF-8), and can be replaced with
``dumps=``; both paths write the same bytes for the same value (see
:func:`json_default` for the types beyond JSON's own). A pydantic model is written as
its ``model_dump(mode="json")``: pydantic is never imported here (a model exists
only if its program imported pydantic already), so ``import tether`` stays light.

Shaping what goes on the wire, from the lightest touch to the heaviest:
``transform=`` (a function of one output to the value written, for a stream's
outputs), overriding :meth:`Encoder.encode` (one output to one whole frame: the
one override point, which :meth:`Encoder.encode_many` and
:meth:`Encoder.encode_indexed` go through whenever a subclass overrides it), or
overriding those two for whole chunks.

SSE can also write the optional fields of the format: ``retry:`` once at the start
(``SSE(retry=...)``), an ``id:`` per output (:meth:`Encoder.encode_events`, used by
resumable streams, whose ids a reconnect sends back as ``Last-Event-ID``) and an
``event:`` name on the error event (``SSE(error_event="error")``, and always on
resumable streams). The defaults write none of them: plain ``data:`` frames are what
OpenAI-style clients read, and a browser ``EventSource`` dispatches a named
``error`` event to the same listeners as its own connection errors.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import enum
import json
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final, Self

from .types import Dumps

__all__ = [
    "NDJSON",
    "SSE",
    "Encoder",
    "ErrorBody",
    "default_dumps",
    "json_default",
    "one_frame",
    "stdlib_dumps",
]


def json_default(value: Any) -> Any:
    """The JSON-ready form of a value the serialiser does not know (its ``default``
    hook), the same on both paths: a pydantic model's ``model_dump(mode="json")``, a
    dataclass's public attributes (its fields in order, then any set beyond them; a
    name starting with ``_`` is left out), an ISO 8601 ``datetime``/``date``/``time``,
    a ``UUID``'s hyphenated text, an enum's value.

    :raises TypeError: ``value`` is of no type tether knows how to write.
    """
    pydantic = sys.modules.get("pydantic")  # loaded if and only if a model can exist
    if pydantic is not None and isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, datetime.date | datetime.time):  # (datetime is a date)
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # As orjson writes one natively (fast, so it is left to it): every public
        # attribute of its __dict__, one set beyond the fields too.
        attributes = getattr(value, "__dict__", None)
        if attributes is not None:
            return {name: item for name, item in attributes.items() if name[:1] != "_"}
        return {
            field.name: getattr(value, field.name)
            for field in dataclasses.fields(value)
            if not field.name.startswith("_")
        }
    uuid = sys.modules.get("uuid")  # (a UUID exists only if uuid was imported)
    if uuid is not None and isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as ``None`` (what orjson writes for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


_encode = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":"), default=json_default, allow_nan=False
).encode
_encode_finite = json.JSONEncoder(
    ensure_ascii=False,
    separators=(",", ":"),
    default=lambda value: _finite(json_default(value)),
    allow_nan=False,
).encode


def stdlib_dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON through the standard library, written as orjson writes it:
    NaN and infinities as ``null``, the types of :func:`json_default`; what it cannot
    write (a lone surrogate, a cycle, nesting too deep) raises ``TypeError``.

    Floats are the same numbers on both paths; only an exponent's spelling may differ
    (``1e-07`` here, ``1e-7`` from orjson).
    """
    try:
        try:
            text = _encode(value)
        except ValueError as exc:
            if "Out of range float" not in str(exc):
                raise
            text = _encode_finite(_finite(value))
        return text.encode()
    except (ValueError, RecursionError) as exc:  # (UnicodeEncodeError is a ValueError)
        raise TypeError(f"cannot be written as JSON: {exc}") from exc


def _pick_framing() -> Callable[[bytes, bytes], Dumps] | None:
    """What makes orjson's dumps (with the standard library's answer for whatever it
    refuses) framed by a prefix and a suffix, in one call per output; ``None`` without
    orjson."""
    try:
        import orjson
    except ImportError:
        return None
    fast = orjson.dumps
    # Datetimes are handed to json_default, as on the standard library's path:
    # orjson's own writing rounds a zone offset to the minute.
    options = orjson.OPT_PASSTHROUGH_DATETIME

    def framing(prefix: bytes, suffix: bytes) -> Dumps:
        def fast_dumps(value: Any) -> bytes:
            # Whatever orjson refuses (an int past 64 bits, a non-str key, a time with
            # a zone, nesting past 254 levels...) goes the standard library's way, which
            # writes it or raises: both paths give the same answer for every value.
            # (An empty prefix or suffix is no copy: bytes + b"" is the bytes.)
            try:
                return prefix + fast(value, default=json_default, option=options) + suffix
            except TypeError:
                return prefix + stdlib_dumps(value) + suffix

        return fast_dumps

    return framing


_framing = _pick_framing()

default_dumps: Final[Dumps] = stdlib_dumps if _framing is None else _framing(b"", b"")
"""The JSON serialiser tether uses unless told otherwise: orjson if installed, with
the standard library's answer for whatever orjson refuses (see :func:`stdlib_dumps`)."""


class ErrorBody(dict[str, Any]):
    """An error body (``{"error": {...}}``) standing in a keep-going batch's output
    stream for a failed sub-request: written ``{"index": i, "error": {...}}``."""

    __slots__ = ()


def with_index(index: int, output: Any) -> Any:
    """A batch output as written on the wire: ``{"index": i, "output": output}``, or
    ``{"index": i, "error": {...}}`` for a keep-going batch's failed sub-request
    (an :class:`ErrorBody`).

    The envelope is the same for every output, so the batch's index can never be
    overwritten by a field of the output (an OpenAI-style choice carries its own
    ``"index"``): ``index`` is the sub-request's, ``output`` what it delivered.
    """
    if type(output) is ErrorBody:
        return {"index": index, **output}
    return {"index": index, "output": output}


class Encoder:
    """Base of the streaming encoders: frames outputs, errors, pings and the end.

    Subclass and override :meth:`encode` to change how one output is written: it is
    the one override point, and :meth:`encode_many` / :meth:`encode_indexed` call it
    for every output once a subclass overrides it (otherwise they inline the default
    for speed).

    :param dumps: serialises one JSON value to bytes.
    :param transform: turns each output into the value written (errors, pings and
        the terminal frame are not outputs and are left alone).
    """

    media_type: ClassVar[str] = "application/octet-stream"
    headers: ClassVar[dict[str, str]] = {}
    has_event_ids: ClassVar[bool] = False
    """Whether :meth:`encode_events` is supported (a stream can be resumable)."""
    _own_encode: ClassVar[bool] = False
    """Whether this class overrides :meth:`encode` (set for each subclass)."""

    __slots__ = ("dumps", "transform")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._own_encode = cls.encode is not Encoder.encode

    def __init__(
        self, *, dumps: Dumps | None = None, transform: Callable[[Any], Any] | None = None
    ) -> None:
        self.dumps: Dumps = dumps or default_dumps
        self.transform = transform

    def shaped(self, transform: Callable[[Any], Any]) -> Self:
        """A copy of this encoder whose outputs go through ``transform`` first (after
        any transform it already has)."""
        shaped = copy.copy(self)
        before = self.transform
        shaped.transform = transform if before is None else lambda output: transform(before(output))
        return shaped

    def frame(self, payload: bytes) -> bytes:
        """Wrap one serialised JSON value into a frame."""
        raise NotImplementedError

    def encode(self, output: Any) -> bytes:
        """One output as one frame: the override point (see the class docstring).

        ``output`` has been through ``transform`` already; a batch's output comes
        in its envelope (``{"index": i, "output": ...}``).
        """
        return self.frame(self.dumps(output))

    def encode_many(self, outputs: Iterable[Any]) -> bytes:
        """Several outputs as consecutive frames, for one write."""
        transform = self.transform
        if transform is not None:
            outputs = map(transform, outputs)
        if self._own_encode:
            encode = self.encode
            return b"".join([encode(output) for output in outputs])
        frame, dumps = self.frame, self.dumps
        return b"".join([frame(dumps(output)) for output in outputs])

    def encode_indexed(self, pairs: Iterable[tuple[int, Any]]) -> bytes:
        """Several ``(index, output)`` pairs of a batch as consecutive frames."""
        transform = self.transform
        if transform is not None:
            pairs = [(index, transform(output)) for index, output in pairs]
        if self._own_encode:
            encode = self.encode
            return b"".join([encode(with_index(index, output)) for index, output in pairs])
        frame, dumps = self.frame, self.dumps
        return b"".join([frame(dumps(with_index(index, output))) for index, output in pairs])

    def encode_events(self, events: Iterable[tuple[str, Any]]) -> bytes:
        """Several ``(event id, output)`` pairs as consecutive frames, each carrying
        its id (resumable streams). Only formats with event ids support it.

        :raises TypeError: the format has no event ids (see :attr:`has_event_ids`).
        """
        raise TypeError(f"{type(self).__name__} has no event ids: resumable streams need SSE")

    def error(self, body: dict[str, Any], *, event: str | None = None) -> bytes:
        """An error event (``body`` is ``{"error": {...}}``, see ``tether.error_body``).

        :param event: an event name for formats that have them (SSE's ``event:``).
        """
        return self.frame(self.dumps(body))

    def preamble(self) -> bytes:
        """What a stream starts with before its first output; ``b""`` by default."""
        return b""

    def terminal(self) -> bytes:
        """The frame that ends a stream; ``b""`` when the format has none."""
        return b""

    def ping(self) -> bytes:
        """A keep-alive that clients ignore."""
        raise NotImplementedError


class SSE(Encoder):
    """Server-sent events: ``data: <json>\\n\\n``, ending with ``data: [DONE]\\n\\n``,
    pinging with a ``: ping`` comment.

    :param dumps: serialises one JSON value to bytes.
    :param transform: turns each output into the value written.
    :param retry: milliseconds a browser ``EventSource`` waits before it reconnects,
        written once as a ``retry:`` field at the start of the stream; ``None`` (the
        default) writes no field.
    :param error_event: the ``event:`` name of the error event sent after the stream
        started; ``None`` (the default) sends it as a plain ``data:`` frame, as
        OpenAI-style clients expect. Resumable streams always name it ``error``.
    :raises ValueError: a negative ``retry``, or an ``error_event`` with a line break.
    """

    media_type: ClassVar[str] = "text/event-stream"
    headers: ClassVar[dict[str, str]] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    has_event_ids: ClassVar[bool] = True

    __slots__ = ("error_event", "retry")

    def __init__(
        self,
        *,
        dumps: Dumps | None = None,
        transform: Callable[[Any], Any] | None = None,
        retry: int | None = None,
        error_event: str | None = None,
    ) -> None:
        super().__init__(dumps=dumps, transform=transform)
        if retry is not None and (isinstance(retry, bool) or not retry >= 0):
            raise ValueError(f"retry is a number of milliseconds >= 0, got {retry!r}")
        if error_event is not None and not _is_field_value(error_event):
            raise ValueError(f"an event name cannot hold a line break: {error_event!r}")
        self.retry = retry
        self.error_event = error_event

    def frame(self, payload: bytes) -> bytes:
        return b"data: " + payload + b"\n\n"

    def encode_events(self, events: Iterable[tuple[str, Any]]) -> bytes:
        # Each output through encode_many, so that a transform or a subclass that
        # shapes its outputs (an OpenAI chunk, say) keeps its shape with an id.
        encode_many = self.encode_many
        return b"".join(
            [
                b"id: " + event_id.encode() + b"\n" + encode_many((output,))
                for event_id, output in events
            ]
        )

    def error(self, body: dict[str, Any], *, event: str | None = None) -> bytes:
        name = event or self.error_event
        data = b"data: " + self.dumps(body) + b"\n\n"
        return data if name is None else b"event: " + name.encode() + b"\n" + data

    def preamble(self) -> bytes:
        return b"" if self.retry is None else b"retry: %d\n\n" % self.retry

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


# The default serialiser's frames, each in its one call: built once, shared by every
# stream (a closure per stream would live as long as the stream, idle or not).
_SSE_FRAMED: Final = None if _framing is None else _framing(b"data: ", b"\n\n")
_NDJSON_FRAMED: Final = None if _framing is None else _framing(b"", b"\n")


def one_frame(encoder: Encoder) -> Callable[[Any], bytes]:
    """``encoder.encode``, with fewer calls per output where its framing is tether's
    own (SSE's, NDJSON's, not overridden): the same bytes, for the write of one output."""
    cls = type(encoder)
    if cls.encode is not Encoder.encode:
        return encoder.encode
    dumps = encoder.dumps
    default = dumps is default_dumps
    if cls.frame is SSE.frame:
        if default and _SSE_FRAMED is not None:
            return _SSE_FRAMED
        return lambda output: b"data: " + dumps(output) + b"\n\n"
    if cls.frame is NDJSON.frame:
        if default and _NDJSON_FRAMED is not None:
            return _NDJSON_FRAMED
        return lambda output: dumps(output) + b"\n"
    return encoder.encode


def _is_field_value(value: str) -> bool:
    """Whether ``value`` fits in one SSE field (no line break ends it early)."""
    return "\n" not in value and "\r" not in value and "\0" not in value
