"""The rooms of hooktrace import one way, read from the source with ``ast`` (nothing imported).

Dependencies point down: ``cli`` on top; ``recorder`` (torch) and ``analyze`` (no torch) side
by side, neither importing the other; ``trace``, the format between them, under both;
``errors`` at the bottom. Every ``import`` counts, at the top of a file or inside a function
(a lazy import is still a dependency), and so does ``importlib.import_module("...")`` with a
literal name. Imports under ``if TYPE_CHECKING:`` are not exempt: a room whose annotations
name another room's types knows that room, and none needs to.

The package root (``hooktrace/__init__.py``, the public API) and ``__main__.py`` sit above
every room. A room may still import the root for what the root itself holds (``__version__``,
the error types it re-exports); a name the root only forwards (``load``, ``diff``,
``record``, ...) counts as an import of the room it comes from.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hooktrace"

ALLOWED = {
    "errors": set(),
    "trace": {"errors"},
    "analyze": {"errors", "trace"},
    "recorder": {"errors", "trace"},
    "cli": {"errors", "trace", "analyze", "recorder"},
}
"""The rooms each room may import (besides itself and the root's own names)."""

TOP = {"__init__", "__main__"}  # the public API and ``python -m hooktrace``: may import any room

NO_TORCH = {"errors", "trace", "analyze"}
"""Rooms that never import torch: the analyzer runs where torch is not installed
(tests/test_no_torch.py imports them with torch blocked; this also catches lazy imports no
test happens to run)."""

DIRECTION = (
    "dependencies point down: cli -> recorder | analyze -> trace -> errors "
    "(recorder and analyze never import each other)"
)


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # the module imported, dotted ("hooktrace.trace.reader", "torch.nn")
    text: str  # as written in the file

    def __str__(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}: `{self.text}`"


def room_of(path: Path) -> str:
    """``hooktrace/trace/reader.py`` -> ``trace``; ``hooktrace/errors.py`` -> ``errors``."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def imports(path: Path) -> list[Import]:
    """Every import in ``path``, wherever it stands in the file, with relative imports made
    absolute and names imported from the root resolved to where the root gets them."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    lines = source.splitlines()
    for node in ast.walk(tree):
        text = lines[node.lineno - 1].strip() if isinstance(node, ast.stmt | ast.expr) else ""
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name, text) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base == "hooktrace":
                found += [Import(path, node.lineno, _from_root(a.name), text) for a in node.names]
            else:
                found.append(Import(path, node.lineno, base, text))
        elif (
            isinstance(node, ast.Call)
            and _called(node.func) in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(path, node.lineno, node.args[0].value, text))
    return found


def _called(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _root_forwards() -> dict[str, str]:
    """The names ``hooktrace/__init__.py`` forwards from a room: its ``_LAZY`` table (name ->
    module, imported on first use), and ``record`` and ``watch``, the recorder's entry points."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_LAZY":
            assert node.value is not None
            table = ast.literal_eval(node.value)
            return {**table, "record": "hooktrace.recorder", "watch": "hooktrace.recorder"}
    raise AssertionError("hooktrace/__init__.py has no _LAZY table: update this test")


FORWARDS = _root_forwards()


def _from_root(name: str) -> str:
    """What ``from hooktrace import name`` depends on."""
    if name in FORWARDS:
        return FORWARDS[name]
    if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
        return f"hooktrace.{name}"  # a room or a top-level module
    return "hooktrace"  # the root's own names: __version__, the error types, _imported_in


FILES = sorted(PACKAGE.rglob("*.py"))


def target_room(module: str) -> str | None:
    """The room ``module`` belongs to; "" for the root itself, None outside hooktrace."""
    parts = module.split(".")
    if parts[0] != "hooktrace":
        return None
    return parts[1] if len(parts) > 1 else ""


def test_every_file_is_in_a_known_room() -> None:
    rooms = {room_of(p) for p in FILES}
    assert FILES and rooms <= set(ALLOWED) | TOP, (
        f"{sorted(rooms - set(ALLOWED) - TOP)}: a new room or top-level module; say in "
        "tests/test_architecture.py's ALLOWED what it may import (" + DIRECTION + ")"
    )


def wrong_way(path: Path) -> list[str]:
    """The imports of ``path`` that point the wrong way, each as file:line: the import, and
    what its room may import."""
    room = room_of(path)
    if room in TOP:
        return []
    allowed = ", ".join(sorted(ALLOWED[room])) or "nothing of hooktrace"
    return [
        f"{found}: {room} imports {target}; {room} may import {allowed}"
        for found in imports(path)
        if (target := target_room(found.module)) not in (None, "", room)
        and target not in ALLOWED[room]
    ]


def torch_imports(path: Path) -> list[str]:
    return [str(i) for i in imports(path) if i.module.split(".")[0] == "torch"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    wrong = wrong_way(path)
    assert not wrong, "\n".join([*wrong, DIRECTION])


@pytest.mark.parametrize(
    "path",
    [p for p in FILES if room_of(p) in NO_TORCH],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_analyzer_side_never_imports_torch(path: Path) -> None:
    wrong = torch_imports(path)
    assert not wrong, "\n".join(
        [*wrong, f"{room_of(path)} never imports torch: the analyzer runs without it"]
    )


def test_a_forbidden_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above fail on a violation, whichever way it is imported (in a scratch
    package), and pass the imports that point down."""
    package = tmp_path / "hooktrace"
    (package / "trace").mkdir(parents=True)
    (package / "__init__.py").write_text('_LAZY = {"diff": "hooktrace.analyze.diff"}\n')
    module = package / "trace" / "reader.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from hooktrace.errors import TraceError\n"
        "from hooktrace.trace import schema\n"
        "from . import histograms\n"
        "if TYPE_CHECKING:\n"
        "    from hooktrace.analyze.report import Report\n"
        "def timeline():\n"
        "    from ..analyze.timeline import timeline\n"
        "    import hooktrace.cli\n"
        "    from hooktrace import diff, __version__\n"
        "    import torch\n"
        "    importlib.import_module('hooktrace.recorder.recorder')\n"
    )
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "PACKAGE", package)
    monkeypatch.setattr(this, "FORWARDS", _root_forwards())
    wrong = wrong_way(module)
    assert [(w.split(":")[1], w.split(": ")[2].split(";")[0]) for w in wrong] == [
        ("6", "trace imports analyze"),
        ("8", "trace imports analyze"),
        ("9", "trace imports cli"),
        ("10", "trace imports analyze"),
        ("12", "trace imports recorder"),
    ]
    assert wrong[0] == (
        "hooktrace/trace/reader.py:6: `from hooktrace.analyze.report import Report`: "
        "trace imports analyze; trace may import errors"
    )
    assert torch_imports(module) == ["hooktrace/trace/reader.py:11: `import torch`"]
    with pytest.raises(AssertionError, match="dependencies point down"):
        test_imports_point_down(module)
    with pytest.raises(AssertionError, match="never imports torch"):
        test_the_analyzer_side_never_imports_torch(module)
