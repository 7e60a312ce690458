"""Framing: a stream's ready outputs as chunks of bytes, about WRITE_BYTES at most.

A :class:`Framer` encodes what a consumer had ready into one chunk for one write,
and when that is a backlog larger than :data:`WRITE_BYTES`, into several chunks,
never encoded or joined whole: what does not fit in this chunk waits (``carry``)
for the next one, in order. A batch's outputs carry their index; a keep-going
batch's failed sub-request stands in its place as its error's JSON body; a
resumable stream's outputs carry their event ids.
"""

from __future__ import annotations

from typing import Any, Final

from ._encoders import Encoder, ErrorBody, one_frame
from ._responses import error_response

__all__ = ["WRITE_BYTES", "Framer", "error_inline"]

WRITE_BYTES: Final = 256 * 1024
"""About how many bytes one chunk of a stream carries when a backlog is ready: ready
outputs are coalesced into one write up to this, and a larger backlog goes out over
several writes, so that it is never copied whole into one buffer."""

_FIRST_SLICE: Final = 4
"""How many outputs are encoded before their size is known."""


def error_inline(value: Any) -> Any:
    """An output, or the error (a keep-going batch's) that stands in its place as its
    JSON body."""
    if isinstance(value, BaseException):
        return ErrorBody(error_response(value).body)
    return value


class Framer:
    """Encodes ready outputs into chunks of about :data:`WRITE_BYTES`.

    :param encoder: the stream's framing.
    :param indexed: the outputs are a batch's ``(index, output)`` pairs.
    :param errors_inline: a keep-going batch: an error may stand for an output.
    :param numbered: the outputs are a resumable stream's ``(event id, output)`` pairs.
    """

    __slots__ = (
        "_errors_inline",
        "_frame_bytes",
        "_indexed",
        "_numbered",
        "_single",
        "carry",
        "encoder",
    )

    def __init__(
        self, encoder: Encoder, *, indexed: bool, errors_inline: bool, numbered: bool = False
    ) -> None:
        self.encoder = encoder
        self._indexed = indexed
        self._numbered = numbered
        self._errors_inline = errors_inline
        self.carry: list[Any] | None = None
        """Ready outputs that did not fit in the last chunk, for the next one."""
        # The last chunk's bytes per output, to size the next one before encoding it.
        self._frame_bytes = 0
        # One output of a plain stream (the usual chunk) is its one frame, with no list
        # and no join: only where encode_many would do just that (no transform, not
        # overridden for whole chunks).
        plain = not (indexed or numbered) and encoder.transform is None
        whole = type(encoder).encode_many is not Encoder.encode_many
        self._single = one_frame(encoder) if plain and not whole else None

    def take_carry(self) -> list[Any] | None:
        """What is left of a backlog, if anything, now owned by the caller."""
        carry, self.carry = self.carry, None
        return carry

    def some(self, items: list[Any]) -> bytes:
        """Encode the ready ``items`` into one chunk of about :data:`WRITE_BYTES` at most
        (at least one output); what does not fit waits in ``carry`` for the next chunk.

        Outputs are encoded slice by slice: the first of at most :data:`_FIRST_SLICE`
        outputs, each next one sized from the bytes per output measured last, so a
        backlog is never encoded or joined whole, even when its outputs are much
        larger than the chunk before's. The usual case (a few small outputs, sizes
        known) is one slice and no copy of the list.
        """
        count = len(items)
        per_frame = self._frame_bytes
        if per_frame and count <= _FIRST_SLICE and per_frame * count <= WRITE_BYTES:
            single = self._single  # (encode()'s first case, without its call)
            chunk = single(items[0]) if count == 1 and single is not None else self.encode(items)
            self._frame_bytes = len(chunk) // count or 1
            return chunk
        parts: list[bytes] = []
        size = done = 0
        while done < count and size < WRITE_BYTES:
            # Until outputs of this chunk are measured, a few tell the size of the
            # rest (the chunk before may have carried much smaller ones); fewer if
            # those it carried were already large.
            take = max(1, (WRITE_BYTES - size) // per_frame) if per_frame else _FIRST_SLICE
            if not done:
                take = min(take, _FIRST_SLICE)
            part = self.encode(items[done : done + take])
            taken = min(take, count - done)
            per_frame = len(part) // taken or 1
            parts.append(part)
            size += len(part)
            done += taken
        self._frame_bytes = per_frame
        if done < count:
            self.carry = items[done:]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def encode(self, items: list[Any]) -> bytes:
        """Every one of ``items`` as consecutive frames, for one write."""
        single = self._single
        if single is not None and len(items) == 1:
            return single(items[0])
        if self._numbered:
            return self.encoder.encode_events(items)
        if self._indexed:
            if self._errors_inline:
                # a keep-going batch yields a failed sub-request's error in its place
                items = [(index, error_inline(output)) for index, output in items]
            return self.encoder.encode_indexed(items)
        return self.encoder.encode_many(items)
