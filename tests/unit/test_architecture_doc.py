"""docs/architecture.md against the tree: the files and packages it names exist, its map of where
things live lists every package, and the classes it names have the members it says they have.

Paths in the doc are under backend_src/specguide/ unless they start at the repository root. A bare
file name (`graphs.py`) is read in the packages its own line names (`cuda/`: a table row, a map
line), or at the package's top level; so a module of the old flat layout (`scheduler.py` for
`engine/scheduler.py`) fails unless its line says which package it is in."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "backend_src" / "specguide"
DOC = ROOT / "docs" / "architecture.md"

_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[A-Za-z_]\w*\.(?:py|c))\b")
_DIR = re.compile(r"`((?:[a-z_][a-z0-9_]*/)+)`")
_MEMBER = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([a-z_][A-Za-z0-9_]*)`")


def packages() -> list[str]:
    """Every package directory under backend_src/specguide, as `name/` (nested: `a/b/`)."""
    return sorted(p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")
                  if p.parent != PACKAGE)


def resolves(name: str, line: str) -> bool:
    """Whether file `name`, as written on `line` of the doc, exists."""
    name = name.removeprefix("backend_src/specguide/")
    if "/" in name:
        return (PACKAGE / name).is_file() or (ROOT / name).is_file()
    named = [d for d in _DIR.findall(line)] + [m.rsplit("/", 1)[0] + "/" for m in _FILE.findall(line) if "/" in m]
    return any((PACKAGE / d / name).is_file() for d in ["", *named])


def missing_files(text: str) -> list[str]:
    return [f"line {n}: {name}" for n, line in enumerate(text.splitlines(), 1)
            for name in _FILE.findall(line) if not resolves(name, line)]


def test_every_file_the_doc_names_exists():
    assert missing_files(DOC.read_text()) == []


def test_every_package_directory_the_doc_names_exists():
    missing = [d for d in set(_DIR.findall(DOC.read_text()))
               if not (PACKAGE / d).is_dir() and not (ROOT / d).is_dir()]
    assert missing == []


def where_things_live(text: str) -> list[str]:
    """The packages the map lists: each line of the section `## Where things live` starts with one."""
    section = re.search(r"^## Where things live\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/architecture.md has no `## Where things live` section"
    return [m.group(1) for m in re.finditer(r"^- `([a-z_][a-z0-9_/]*/)`", section.group(1), re.M)]


def test_the_map_lists_every_package_and_only_packages():
    listed = where_things_live(DOC.read_text())
    top = [p for p in packages() if p.count("/") == 1]
    assert sorted(set(top) - set(listed)) == [], "packages missing from the map in docs/architecture.md"
    assert sorted(set(listed) - set(packages())) == [], "the map lists packages that do not exist"
    assert len(listed) == len(set(listed))


def class_members() -> dict[str, set[str]]:
    """{class name: the names its body defines, and the attributes its methods set on self}."""
    members: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = members.setdefault(node.name, set())
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                      and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    names.add(sub.attr)
    return members


def test_the_classes_the_doc_names_have_the_members_it_names():
    """`Class.member` in backticks: a class of the package that defines (or sets on self) that member.
    Names that are not a class of ours (`response_sender.send`, a module's function) are not read."""
    members = class_members()
    wrong = sorted({f"{cls}.{name}" for cls, name in _MEMBER.findall(DOC.read_text())
                    if cls in members and name not in members[cls]})
    assert wrong == []


def test_the_checks_catch_the_old_flat_layout():
    assert missing_files("| `scheduler.py` | slots |\n`engine_core.py`\n") == ["line 1: scheduler.py", "line 2: engine_core.py"]
    assert missing_files("| `engine/scheduler.py` | and `step.py` |\n| `cuda/` | `graphs.py` |\n") == []
    assert missing_files("`backend_src/specguide/engine/core.py`, `scripts/config_table.py`, kernels/ops.c\n") == []
    assert where_things_live("## Where things live\n\n- `engine/`: x\n- `util/`: y\n\n## Next\n") == ["engine/", "util/"]
