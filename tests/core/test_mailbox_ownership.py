"""The mailbox classes own their fields: no module but ``_state`` (and ``_mailbox``,
their shared wake-up) writes a field of
``RequestState``, ``Group`` or ``Mailbox`` (read by scanning the core's source), and
every request ends through one method of the table (``Table.end``)."""

from __future__ import annotations

import ast
from pathlib import Path

import tether

CORE = Path(tether.__file__).parent
MAILBOXES = ("Mailbox", "RequestState", "Group")


def _slots(tree: ast.Module, classes: tuple[str, ...] | None = None) -> set[str]:
    """The ``__slots__`` of the classes ``tree`` defines (of ``classes`` only, if given)."""
    fields: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or (classes and node.name not in classes):
            continue
        for item in node.body:
            if isinstance(item, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__slots__" for target in item.targets
            ):
                assert isinstance(item.value, ast.Tuple)
                fields |= {elt.value for elt in item.value.elts if isinstance(elt, ast.Constant)}
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                for sub in ast.walk(item):  # (a class without __slots__ declares in __init__)
                    stored = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                    if stored and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        fields.add(sub.attr)
    return fields


def _writes(tree: ast.Module, fields: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del)
        if stored and node.attr in fields:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_writes_a_field_of_another_modules_mailbox() -> None:
    owners = ("_state.py", "_mailbox.py")
    fields = set().union(*(_slots(ast.parse((CORE / n).read_text()), MAILBOXES) for n in owners))
    assert {"pending", "waiter", "live", "error", "acc"} <= fields  # (the scan sees them)
    broken = {}
    for path in sorted(CORE.glob("*.py")):
        if path.name in owners:
            continue
        tree = ast.parse(path.read_text())
        # A module's own classes may have fields of the same names (a Channel's waiter).
        writes = _writes(tree, fields - _slots(tree))
        if writes:
            broken[path.name] = writes
    assert not broken, f"mailbox fields written outside _state.py: {broken}"


def test_every_request_ends_through_one_method_of_the_table() -> None:
    """The mailbox is closed in one place: ``RequestState.close`` is called by
    ``Table.end`` and by nothing else in the core."""
    callers = []
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
            for method in (node for node in cls.body if isinstance(node, ast.FunctionDef)):
                for node in ast.walk(method):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "close"
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "state"
                    ):
                        callers.append(f"{path.name}:{cls.name}.{method.name}")
    assert callers == ["_table.py:Table.end"]
