"""The byte budget's weighing (``tether.approximate_size``) of values that take its
slower path (a subclass of str, bytes, list or tuple; a set, a frozenset, a bytearray)
is the weight of their plain counterpart: a type test there that misses one would
weigh it as an opaque object."""

from __future__ import annotations

from typing import Any

import pytest

from tether import approximate_size


class Str(str):
    pass


class Bytes(bytes):
    pass


class List(list):  # type: ignore[type-arg]
    pass


class Tuple(tuple):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (Str("abc"), "abc"),
        (Bytes(b"zz"), b"zz"),
        (bytearray(b"hello"), b"hello"),
        (List([1, "x", [2.5]]), [1, "x", [2.5]]),
        (Tuple(("a", 2)), ("a", 2)),
        ({1, 2, "ab"}, [1, 2, "ab"]),
        (frozenset({b"xy", 3}), [b"xy", 3]),
        ({"k": List([Str("v"), {1}])}, {"k": ["v", [1]]}),
    ],
    ids=["str", "bytes", "bytearray", "list", "tuple", "set", "frozenset", "nested"],
)
def test_it_weighs_what_its_plain_counterpart_weighs(value: Any, plain: Any) -> None:
    assert approximate_size(value) == approximate_size(plain)
