"""The reliability suite's fixtures: the example servers run in the test's own loop."""

from __future__ import annotations

import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# The example servers are scripts that import their siblings as top-level modules
# (``api``, ``engine``); the suite imports them the same way.
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
