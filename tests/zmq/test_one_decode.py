"""A frame is decoded once, whichever decoder would read it again: every call into
msgspec's decoding is counted (a profile hook sees each call of a C function), not
only those of the reader's own two decoders."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import msgspec
import pytest

from .test_protocol import _COSTLY_FRAMES

_DECODERS: tuple[type, ...] = (msgspec.msgpack.Decoder, msgspec.json.Decoder)
_FUNCTIONS = frozenset(
    {msgspec.msgpack.decode, msgspec.json.decode, msgspec.convert, msgspec.msgpack.Decoder}
)


def _is_a_decode(called: Any) -> bool:
    owner = getattr(called, "__self__", None)
    if isinstance(owner, _DECODERS) and called.__name__.startswith("decode"):
        return True
    try:
        return called in _FUNCTIONS
    except TypeError:
        return False


@contextlib.contextmanager
def _decodes() -> Iterator[list[str]]:
    """Every call into msgspec's decoding made while inside, by any decoder."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and _is_a_decode(arg):
            calls.append(f"{arg!r} from {frame.f_code.co_name}")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


@pytest.mark.parametrize(("decode", "make"), _COSTLY_FRAMES)
def test_a_frame_refused_for_a_bad_field_is_decoded_once_by_any_decoder(
    decode: Callable[[bytes], object], make: Callable[..., bytes]
) -> None:
    broken = make(bad=True)
    with _decodes() as calls, pytest.raises(msgspec.ValidationError):
        decode(broken)
    assert len(calls) == 1, calls


@pytest.mark.parametrize(("decode", "make"), _COSTLY_FRAMES)
def test_a_newer_peers_frame_is_decoded_once_by_any_decoder(
    decode: Callable[[bytes], object], make: Callable[..., bytes]
) -> None:
    newer = make(extra=msgspec.msgpack.encode("trace-id"))
    with _decodes() as calls:
        decode(newer)
    assert len(calls) == 1, calls
