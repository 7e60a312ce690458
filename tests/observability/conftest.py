"""Fixtures of the observability suite: the example servers (which import their
siblings as top-level modules) are importable, as in the e2e suite."""

from __future__ import annotations

import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
