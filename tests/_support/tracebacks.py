"""Tracebacks printed by a server subprocess, judged by the files their frames run.

A traceback belongs to the project when one of its frames runs a file of tether's
own packages (found where Python imports them from, paths resolved) or of a folder
the test names. Matching the word "tether" in the text would also match every
frame of a dependency installed in a checkout named ``tether``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from collections.abc import Iterable
from typing import Final

PACKAGES: Final = (
    "tether",
    "tether_aiohttp",
    "tether_otel",
    "tether_prometheus",
    "tether_redis",
    "tether_starlette",
    "tether_zmq",
)
"""The project's importable packages (``src/`` and ``adapters/``)."""

HEADER: Final = "Traceback (most recent call last):"
FRAME: Final = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+', re.MULTILINE)


def _package_dirs() -> tuple[pathlib.Path, ...]:
    dirs = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)  # found, not imported: no optional deps
        assert spec is not None, name
        places = spec.submodule_search_locations or []
        assert places, f"{name} is not a package"
        dirs.extend(pathlib.Path(place).resolve() for place in places)
    return tuple(dirs)


def frames(block: str) -> list[pathlib.Path]:
    """The files named by the frames of one traceback, resolved."""
    return [pathlib.Path(match["path"]).resolve() for match in FRAME.finditer(block)]


def tracebacks_through(text: str, *also: pathlib.Path) -> list[str]:
    """The tracebacks in ``text`` with a frame in tether's packages or under ``also``."""
    own = (*_package_dirs(), *(path.resolve() for path in also))
    return [
        block
        for block in text.split(HEADER)[1:]
        if any(_is_under(path, own) for path in frames(block))
    ]


def _is_under(path: pathlib.Path, dirs: Iterable[pathlib.Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in dirs)
