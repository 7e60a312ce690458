"""An ``on_abort`` callback that keeps the rids it is called with."""

from __future__ import annotations

import asyncio


class Aborted(list[str]):
    """The rids ``on_abort`` was called with, in order; ``seen`` is set at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def __call__(self, rid: str) -> None:
        self.append(rid)
        self.seen.set()
