"""The core's modules depend one way: no import cycle, not even under TYPE_CHECKING;
and its namespaces too: the application's core below the HTTP exchange; the adapters
above it stay thin, the HTTP policy they share being the core's."""

from __future__ import annotations

import ast
import pathlib

import tether
import tether_aiohttp
import tether_starlette

PACKAGE = pathlib.Path(tether.__file__).parent

HTTP = {"http", "_exchange", "_framing", "_responses", "_guard", "_responder", "_drain", "_shapes"}
"""``tether.http``: one HTTP exchange and its one write loop, for adapter authors."""

RESUME = {"resume", "_resume", "_resume_log", "_memory_store"}
"""Resumable streams, for store authors: above the core and the exchange."""


def _imports(path: pathlib.Path) -> set[str]:
    """The sibling modules ``path`` imports, at run time or for type checking."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tether."):
            found.add((node.module or "").split(".")[1])
    return found


def _graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in PACKAGE.glob("*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def test_no_module_of_the_core_imports_another_that_imports_it_back() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert graph["_registry"] >= {"_table", "_stream", "_batch"}  # the front sits on top
    assert not graph["_table"] & {"_registry", "_stream", "_batch", "_consumer", "_scope"}
    assert not graph["_state"] & {"_table", "_registry", "_stream", "_batch", "_consumer"}
    assert not graph["_limits"] & {"_state", "_table", "_registry", "_consumer"}


def _package(module: str) -> str:
    return "http" if module in HTTP else "resume" if module in RESUME else "core"


ALLOWED = {"core": {"core"}, "http": {"core", "http"}, "resume": {"core", "http", "resume"}}
"""Three audiences, three namespaces, depending down: the core (``tether``), the HTTP
exchange on it (``tether.http``), resumable streams on both (``tether.resume``)."""


def test_each_namespace_imports_only_the_ones_below_it() -> None:
    graph = _graph()
    wrong = {
        f"{name} -> {imported}"
        for name, imports in graph.items()
        if name != "__init__"
        for imported in imports
        if _package(imported) not in ALLOWED[_package(name)]
    }
    assert wrong == set()
    # the top level imports neither tether.http nor tether.resume
    assert {_package(name) for name in graph["__init__"]} <= {"core"}
    assert {"http", "resume"} & graph["__init__"] == set()


def test_the_namespaces_hold_what_they_say() -> None:
    modules = set(_graph())
    assert modules >= HTTP | RESUME
    assert _package("http") == "http"
    assert _package("resume") == "resume"


ADAPTER_LINES = {tether_starlette: 605, tether_aiohttp: 400}
"""The most lines (docstrings included) of each adapter package: past it, something both
adapters need has probably grown in one of them instead of in ``tether.http``. (Starlette
605: ``producer_writes="threads"``, a choice about an ASGI send chain aiohttp has none of.)"""


def test_adapters_stay_thin_the_shared_http_policy_living_in_the_core() -> None:
    for adapter, most in ADAPTER_LINES.items():
        folder = pathlib.Path(adapter.__file__).parent
        lines = sum(len(path.read_text().splitlines()) for path in folder.glob("*.py"))
        assert lines <= most, f"{adapter.__name__} has {lines} lines, more than {most}"
