"""A server's traceback counts as tether's by the files its frames run, not by a word."""

from __future__ import annotations

import pathlib

import tether
from tests._support.tracebacks import tracebacks_through

CORE = pathlib.Path(tether.__file__).resolve().parent


def traceback(*files: pathlib.Path) -> str:
    frames = "".join(f'  File "{path}", line 1, in f\n    f()\n' for path in files)
    return f"Traceback (most recent call last):\n{frames}RuntimeError: boom\n"


def test_a_dependency_installed_in_a_checkout_named_tether_is_not_tether(
    tmp_path: pathlib.Path,
) -> None:
    hypercorn = tmp_path / "tether" / ".venv" / "lib" / "site-packages" / "hypercorn" / "run.py"
    assert tracebacks_through(traceback(hypercorn)) == []


def test_a_frame_in_tethers_package_or_in_a_named_file_counts(tmp_path: pathlib.Path) -> None:
    app = tmp_path / "app.py"
    other = tmp_path / "other.py"
    ours, theirs, apps = traceback(other, CORE / "_table.py"), traceback(other), traceback(app)
    assert tracebacks_through(ours + theirs + apps, app) == [
        part.removeprefix("Traceback (most recent call last):") for part in (ours, apps)
    ]


def test_a_path_through_a_symlink_is_judged_where_it_resolves(tmp_path: pathlib.Path) -> None:
    (tmp_path / "link").symlink_to(CORE)
    assert len(tracebacks_through(traceback(tmp_path / "link" / "_table.py"))) == 1
