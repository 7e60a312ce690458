"""Review 3: a Step of too many entries is measured by walking its outputs' headers
("a few ms of walking, once, as the session ends", decode_at_front). A front with no
session (down: its hello refused, say) ends nothing, yet walks every such frame again."""

from __future__ import annotations

import asyncio
import time

import pytest

import tether_zmq._protocol as wire
from tether_zmq import PROTOCOL_VERSION

from .conftest import eventually
from .test_protocol import greeted_engine

pytestmark = pytest.mark.timeout(120)

FRAMES = 40


async def test_a_step_of_too_many_entries_sent_to_a_front_without_a_session_is_walked_at_most_once(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[int] = []
    walk = wire._step_entries  # noqa: SLF001

    def counted(frame: bytes | memoryview) -> int:
        walks.append(1)
        return walk(frame)

    monkeypatch.setattr(wire, "_step_entries", counted)
    # 4096 outputs that msgspec builds, then a failures list one past the cap: refused at
    # the failures' header, then the 4096 outputs walked in Python to count the entries.
    hostile = wire.encode(
        wire.Step(1, [(1, b"x" * 8, False)] * wire.MAX_ENTRIES, [(1, "", 400)] * (wire.MAX_ENTRIES + 1))
    )
    async with greeted_engine(address) as (client, send, _):
        reason = f"{wire.HELLO_TOO_LARGE}: 20000 bytes (at most 16384)"
        await send(wire.Refuse(0, PROTOCOL_VERSION, reason))
        await eventually(lambda: client.stats().refused == 1)
        assert not client.ready
        before = client.stats().malformed
        started = time.perf_counter()
        for _ in range(FRAMES):
            await send(hostile)
        await eventually(lambda: client.stats().malformed >= before + FRAMES)
        spent = time.perf_counter() - started
        assert not client.ready
    per_frame = 1e3 * spent / FRAMES
    assert len(walks) <= 1, (
        f"a front without a session walked {len(walks)} of {FRAMES} hostile Steps' headers "
        f"({per_frame:.2f} ms a frame, including the wire): the walk tells only a session "
        "that ends, and none does"
    )
