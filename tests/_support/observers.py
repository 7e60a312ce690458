"""An observer double that records every hook call (tether.Observer)."""

from __future__ import annotations

from collections.abc import Sequence

import tether


class Recorder(tether.Observer):
    """Records every hook call, in order."""

    def __init__(self) -> None:
        self.opens: list[tuple[tuple[str, ...], bool, str | None]] = []
        self.firsts: list[tuple[str, float]] = []
        self.ends: dict[str, tether.RequestEnd] = {}

    def on_open(self, rids: Sequence[str], *, batch: bool, request_id: str | None) -> None:
        self.opens.append((tuple(rids), batch, request_id))

    def on_first_output(self, rid: str, elapsed: float) -> None:
        self.firsts.append((rid, elapsed))

    def on_end(self, end: tether.RequestEnd) -> None:
        assert end.rid not in self.ends, "one end per request"
        self.ends[end.rid] = end
