"""The rooms of hooktrace import one way, read from the source with ``ast`` (nothing imported).

Dependencies point down: ``cli`` on top; ``recorder`` (torch) and ``analyze`` (no torch) side
by side, neither importing the other; ``trace``, the format between them, under both;
``errors`` at the bottom. Every ``import`` counts, at the top of a file or inside a function
(a lazy import is still a dependency), and so does ``importlib.import_module("...")`` with a
literal name. Imports under ``if TYPE_CHECKING:`` are not exempt: a room whose annotations
name another room's types knows that room, and none needs to.

The package root (``hooktrace/__init__.py``, the public API) and ``__main__.py`` sit above
every room. A room may still import the root for what the root itself holds (the error types
it re-exports); a name the root only forwards (``load``, ``diff``, ``record``, ...) counts as
an import of the room it comes from. ``package`` (the version, the process that imported
hooktrace) sits at the bottom beside ``errors``.

Inside ``recorder`` and ``analyze``, each sub-package's ``__init__.py`` says on its line
``May import:`` which of its room's other sub-packages it imports; that line is held true
here. And no module imports itself through others: no import circle, anywhere.
"""

from __future__ import annotations

import ast
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hooktrace"

ALLOWED = {
    "errors": set(),
    "package": set(),
    "trace": {"errors", "package"},
    "analyze": {"errors", "package", "trace"},
    "recorder": {"errors", "package", "trace"},
    "cli": {"errors", "package", "trace", "analyze", "recorder"},
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


def module_name(path: Path) -> str:
    """``hooktrace/trace/reader.py`` -> ``hooktrace.trace.reader``; a package's
    ``__init__.py`` -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of hooktrace (a file, not a name in one)."""
    parts = dotted.split(".")
    if parts[0] != "hooktrace":
        return False
    where = PACKAGE.parent.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def room_of(path: Path) -> str:
    """``hooktrace/trace/reader.py`` -> ``trace``; ``hooktrace/errors.py`` -> ``errors``."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def imports(path: Path) -> list[Import]:
    """Every import in ``path``, wherever it stands in the file, with relative imports made
    absolute and names imported from the root resolved to where the root gets them."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    package = module_name(path)
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
            else:  # ``from package import module`` imports the module
                found += [
                    Import(path, node.lineno, f"{base}.{a.name}", text)
                    if _is_module(f"{base}.{a.name}")
                    else Import(path, node.lineno, base, text)
                    for a in node.names
                ]
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
    return "hooktrace"  # the root's own names: __version__, the error types


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
    (package / "__init__.py").write_text('_LAZY = {"diff": "hooktrace.analyze.diff.diff"}\n')
    module = package / "trace" / "reader.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from hooktrace.errors import TraceError\n"
        "from hooktrace.trace import schema\n"
        "from . import histograms\n"
        "if TYPE_CHECKING:\n"
        "    from hooktrace.analyze.report.report import Report\n"
        "def timeline():\n"
        "    from ..analyze.timeline import timeline\n"
        "    import hooktrace.cli\n"
        "    from hooktrace import diff, __version__\n"
        "    import torch\n"
        "    importlib.import_module('hooktrace.recorder.recording.recorder')\n"
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
        "hooktrace/trace/reader.py:6: `from hooktrace.analyze.report.report import Report`: "
        "trace imports analyze; trace may import errors, package"
    )
    assert torch_imports(module) == ["hooktrace/trace/reader.py:11: `import torch`"]
    with pytest.raises(AssertionError, match="dependencies point down"):
        test_imports_point_down(module)
    with pytest.raises(AssertionError, match="never imports torch"):
        test_the_analyzer_side_never_imports_torch(module)


# -- the sub-packages of recorder and analyze --------------------------------------------------

SPLIT = ("recorder", "analyze")
"""The rooms split into sub-packages, each saying in its ``__init__.py`` what it may import."""


def sub_room_of(path: Path) -> str | None:
    """``hooktrace/recorder/stats/kernel.py`` -> ``stats``; ``hooktrace/analyze/findings.py``
    -> ``findings`` (a module beside the sub-packages is a sub-room of its own); None outside
    ``recorder`` and ``analyze`` and for their own ``__init__.py``."""
    parts = path.relative_to(PACKAGE).parts
    if parts[0] not in SPLIT or parts[1:] == ("__init__.py",):
        return None
    return Path(parts[1]).stem


def declared(room: str, sub_room: str) -> set[str] | None:
    """The sub-rooms ``hooktrace/ROOM/SUB_ROOM/__init__.py`` says it may import, on its line
    ``May import: a, b.`` ("nothing of the ...": none); None for a sub-room that is a module."""
    init = PACKAGE / room / sub_room / "__init__.py"
    if not init.is_file():
        return None
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert len(lines) == 1, f"{init.relative_to(PACKAGE.parent)}: say once `May import: ...`"
    names = lines[0].removeprefix("May import:").strip().rstrip(".")
    return set() if names.startswith("nothing") else {n.strip() for n in names.split(",")}


SUB_ROOMS = sorted(
    {(path.relative_to(PACKAGE).parts[0], room) for path in FILES if (room := sub_room_of(path))}
)


@pytest.mark.parametrize("room, sub_room", SUB_ROOMS, ids=lambda r: str(r))
def test_sub_rooms_import_what_they_say(room: str, sub_room: str) -> None:
    may = declared(room, sub_room)
    if may is None:  # a module beside the sub-packages (analyze/findings.py): the floor
        may = set()
    siblings = {p.stem if p.suffix else p.name for p in (PACKAGE / room).iterdir()}
    assert may <= siblings, f"{room}/{sub_room} may import {sorted(may - siblings)}: no such room"
    wrong = [
        f"{found}: {room}/{sub_room} imports {room}/{target}; it may import "
        f"{', '.join(sorted(may)) or 'nothing of ' + room} (say so in its __init__.py)"
        for path in FILES
        if sub_room_of(path) == sub_room and path.relative_to(PACKAGE).parts[0] == room
        for found in imports(path)
        if (parts := found.module.split("."))[:2] == ["hooktrace", room]
        and len(parts) > 2
        and (target := parts[2]) != sub_room
        and target not in may
    ]
    assert not wrong, "\n".join(wrong)


def test_every_sub_room_says_what_it_holds() -> None:
    for room in SPLIT:
        for init in sorted((PACKAGE / room).glob("*/__init__.py")):
            tree = ast.parse(init.read_text(encoding="utf-8"))
            doc = ast.get_docstring(tree)
            assert doc and len(doc.splitlines()) > 2, f"{init}: say what this room holds"
            assert len(tree.body) == 1, f"{init}: a room's __init__.py is its docstring only"


# -- no import circles --------------------------------------------------------------------------


def graph(files: list[Path]) -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first import that says so}, within hooktrace."""
    known = {module_name(p) for p in files}
    edges: dict[str, dict[str, Import]] = {}
    for path in files:
        this = module_name(path)
        out = edges.setdefault(this, {})
        for found in imports(path):
            target = found.module
            while target not in known and "." in target:  # ``a.b.name``: the module a.b
                target = target.rpartition(".")[0]
            if target in known and target != this:
                out.setdefault(target, found)
    return edges


def circles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Each import circle once, as the modules around it (the first one repeated at the end),
    found by a depth-first walk that stops at the first way back to a module on its path."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(edges.get(module, {})):
            if target in path:
                circle = [*path[path.index(target) :], target]
                start = circle.index(min(circle[:-1]))  # the same circle found twice: once
                key = [*circle[start:-1], *circle[:start], circle[start]]
                if key not in found:
                    found.append(key)
            elif target not in done:
                walk(target, [*path, target])
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            walk(module, [module])
    return found


def describe(circle: list[str], edges: dict[str, dict[str, Import]]) -> str:
    return (
        " -> ".join(circle)
        + "\n"
        + "\n".join(f"  {edges[a][b]}" for a, b in itertools.pairwise(circle))
    )


def test_no_import_circle() -> None:
    """Every import counts (lazy, under TYPE_CHECKING): a circle means two modules that cannot
    be read, tested or moved apart. Name what a module needs of a higher one with a Protocol,
    or move what both need below them."""
    edges = graph(FILES)
    found = circles(edges)
    assert not found, "import circles:\n" + "\n".join(describe(c, edges) for c in found)


def test_an_import_circle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "hooktrace"
    (package / "trace").mkdir(parents=True)
    (package / "__init__.py").write_text("_LAZY = {}\n")
    (package / "errors.py").write_text("")
    (package / "trace" / "__init__.py").write_text("")
    (package / "trace" / "reader.py").write_text("from hooktrace.trace import stream\n")
    (package / "trace" / "stream.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from hooktrace.errors import TraceError\n"
        "if TYPE_CHECKING:\n"
        "    from hooktrace.trace.reader import Trace\n"
    )
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "PACKAGE", package)
    monkeypatch.setattr(this, "FORWARDS", _root_forwards())
    files = sorted(package.rglob("*.py"))
    edges = graph(files)
    assert circles(edges) == [
        ["hooktrace.trace.reader", "hooktrace.trace.stream", "hooktrace.trace.reader"]
    ]
    assert "hooktrace/trace/stream.py:4: `from hooktrace.trace.reader import Trace`" in describe(
        circles(edges)[0], edges
    )
    (package / "trace" / "stream.py").write_text("from hooktrace.errors import TraceError\n")
    assert circles(graph(files)) == []
