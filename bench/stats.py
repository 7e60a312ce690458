"""Small measurement helpers shared by the load client and the orchestrator:
percentiles, and a process's CPU time and resident memory read from ``/proc``."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

__all__ = ["cpu_seconds", "percentile", "rss_bytes"]

_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (0 for pid 0)."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rpartition(")")[2].split()
    # fields[0] is the state (field 3 of stat(5)); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), in bytes."""
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
