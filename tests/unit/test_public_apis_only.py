"""The package uses the standard library's public modules only: no `re._parser`, `sre_parse` or
other private module (CPython changes those in any release, as it moved sre_parse to re._parser)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "backend_src" / "specguide"
PRIVATE_ALIASES = {"sre_parse", "sre_compile", "sre_constants"}  # deprecated aliases of re's private modules
DOCUMENTED = {"os._exit", "sys._getframe", "sys._current_frames", "sys._xoptions"}  # public despite the underscore


def private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each import of a private standard-library module, or attribute read of one
    (`re._parser`), in `tree`."""
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        for name in names:
            parts = name.split(".")
            stdlib = parts[0] in sys.stdlib_module_names and parts[0] != "__future__"
            if name in DOCUMENTED:
                continue
            if stdlib and (parts[0] in PRIVATE_ALIASES or parts[0].startswith("_")
                           or any(p.startswith("_") and not p.startswith("__") for p in parts[1:2])):
                out.append((node.lineno, name))
    return out


def test_the_check_finds_private_modules():
    code = "import re\nimport sre_parse\nfrom re import _parser\nfrom re._parser import parse\nx = re._parser.parse('a')\n" \
           "import _thread\nfrom os import path\ny = re.compile('a')\nz = os.__name__\nos._exit(0)\n"
    found = sorted({name for _, name in private_uses(ast.parse(code))})
    assert found == ["_thread", "re._parser", "re._parser.parse", "sre_parse"]


def test_no_private_standard_library_module_is_used():
    bad = [f"{f.relative_to(PACKAGE)}:{line}: {name}"
           for f in sorted(PACKAGE.rglob("*.py")) for line, name in private_uses(ast.parse(f.read_text()))]
    assert not bad, "\n".join(bad)
