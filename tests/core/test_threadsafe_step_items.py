"""What a producer thread hands over with deliver_many_threadsafe() is checked where it
is handed over: an item the loop could not read as ``(rid, output, finished)`` is
refused in the producer's thread, and nothing of its step reaches the loop."""

from __future__ import annotations

from typing import Any

import pytest

import tether

from .conftest import hand_over_a_bad_step


def _one_shot(rid: str) -> Any:
    return iter((rid, "out", False))  # three items, once


def _mapping(rid: str) -> Any:
    # three keys: it unpacks, to its keys ("rid", "output", "finished")
    return {"rid": rid, "output": "out", "finished": False}


@pytest.mark.parametrize("make", [_one_shot, _mapping], ids=["one-shot-iterator", "mapping"])
async def test_an_item_the_loop_cannot_read_as_a_triple_is_refused_in_the_producers_thread(
    registry: tether.Registry, make: Any
) -> None:
    received, refused, loop_errors = await hand_over_a_bad_step(registry, make)
    assert loop_errors == []
    assert len(refused) == 1, f"handed over, and the loop read {received!r}"
    assert received == ["after"]
    assert registry.in_flight == 0
