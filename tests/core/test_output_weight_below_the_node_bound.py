"""An output of at most ``_SIZE_NODES`` values (containers, objects, keys and leaves,
each counted once) is weighed by its walk: the documented sum of its parts, however many
of its values are containers, and however deep they nest. Only past the bound is its
JSON encoding measured instead."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import tether
from tether._limits import _SIZE_NODES


def _parts_and_nodes(value: Any) -> tuple[int, int]:
    """The documented weight (a word per value, a string's length, an int's digits, a
    container's parts) and the number of values, without recursion (deep outputs)."""
    weight = nodes = 0
    todo = [value]
    while todo:
        item = todo.pop()
        nodes += 1
        weight += 8
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
        elif isinstance(item, str | bytes):
            weight += len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            weight += item.bit_length() >> 2
        elif hasattr(item, "__dict__"):  # an object: 64, and its fields as a dict's
            weight += 64
            todo.extend(vars(item).keys())
            todo.extend(vars(item).values())
    return weight, nodes


@dataclasses.dataclass
class Point:
    x: float
    y: float


class Marker:
    """An object without fields."""


def _nested(depth: int) -> list[Any]:
    value: list[Any] = [0]
    for _ in range(depth - 1):
        value = [value]
    return value


OUTPUTS = {
    "a polyline of 20,000 coordinate pairs": [[0.5, 1.5] for _ in range(20_000)],
    "30,000 one-item tuples": tuple((n,) for n in range(30_000)),
    "a dict of 20,000 ids to one-item lists": {n: [n] for n in range(20_000)},
    "rows of small records": [{"id": n, "tags": ["a"]} for n in range(10_000)],
    "40,000 lists deep": _nested(40_000),
    "12,000 dataclass points": [Point(0.5, 1.5) for _ in range(12_000)],
    "33,000 objects without fields": [Marker() for _ in range(33_000)],
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_an_output_below_the_node_bound_weighs_the_sum_of_its_parts(name: str) -> None:
    output = OUTPUTS[name]
    weight, nodes = _parts_and_nodes(output)
    assert nodes <= _SIZE_NODES  # below the bound: walked, not encoded
    assert tether.approximate_size(output) == weight
