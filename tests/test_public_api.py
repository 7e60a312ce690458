"""The public namespace: a sorted ``__all__`` holding DESIGN.md's contract, no framework."""

from __future__ import annotations

import subprocess
import sys
import types

import tether

CONTRACT = {
    "Registry",
    "Stream",
    "Batch",
    "RequestScope",
    "TetherError",
    "DuplicateRequest",
    "UnknownRequest",
    "Overloaded",
    "RegistryClosed",
    "Aborted",
    "RequestTimeout",
    "ProducerError",
    "ConsumerTooSlow",
    "SSE",
    "NDJSON",
}


def _isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions: the order ruff's RUF022 keeps."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


def test_all_is_sorted_and_holds_every_contract_name() -> None:
    assert tether.__all__ == sorted(tether.__all__, key=_isort_key)
    assert set(tether.__all__) >= CONTRACT


def test_all_lists_every_public_name_of_the_package() -> None:
    public = {
        name
        for name, value in vars(tether).items()
        if not name.startswith("_")
        and name != "annotations"  # the __future__ import
        and not isinstance(value, types.ModuleType)
    }
    assert public == set(tether.__all__)


def test_every_exported_name_exists_and_is_documented() -> None:
    for name in tether.__all__:
        value = getattr(tether, name)
        if callable(value):
            assert value.__doc__, f"tether.{name} has no docstring"


def test_every_error_derives_from_tether_error() -> None:
    for name in CONTRACT:
        value = getattr(tether, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, tether.TetherError)


def test_importing_tether_loads_no_web_framework() -> None:
    probe = (
        "import sys, tether; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'aiohttp')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
