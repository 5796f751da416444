"""Comments and docstrings say what the code does and why; the history of a choice (the day it was
measured, the run that measured it) lives in bench/HISTORY.md and the commit messages.

Scans the comments (tokenize) and docstrings (ast: every statement that is a bare string, which
includes the attribute docstrings under assignments) of the Python sources, and the comments of
the C sources, for a date (YYYY-MM-DD) and for a reference to bench/HISTORY.md or bench/RESULTS.md.
Strings the code uses (a date regex, a sample value) are never read. A benchmark script that
measures a claim may be named (`bench/bench_kernels.py`)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("backend_src/specguide", "model_repository", "client", "scripts")

FORBIDDEN = [
    ("a date", re.compile(r"(?<![\d-])(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?![\d])")),
    ("a reference to bench/HISTORY.md", re.compile(r"HISTORY\.md")),
    ("a reference to bench/RESULTS.md", re.compile(r"RESULTS\.md")),
]


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every line of every docstring-like string in `source`."""
    lines = source.splitlines()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            # the raw source lines of the string, so a hit names the line the reader sees
            for n in range(node.lineno, node.end_lineno + 1):
                found.append((n, lines[n - 1]))
    return found


_C_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def c_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every line of every comment in C `source` (string and char literals skipped)."""
    found = []
    for m in _C_TOKENS.finditer(source):
        if m.group().startswith(("//", "/*")):
            first = source.count("\n", 0, m.start()) + 1
            found.extend((first + i, text) for i, text in enumerate(m.group().split("\n")))
    return found


def violations(path: Path, source: str) -> list[str]:
    prose = c_prose(source) if path.suffix == ".c" else python_prose(source)
    return [f"{path}:{line}: {what}: {text.strip()}"
            for line, text in sorted(prose) for what, pattern in FORBIDDEN if pattern.search(text)]


def sources() -> list[Path]:
    return sorted(p for top in SCANNED for ext in ("*.py", "*.c") for p in (ROOT / top).rglob(ext))


def test_no_dates_or_bench_history_in_comments_and_docstrings():
    found = [v for p in sources() for v in violations(p.relative_to(ROOT), p.read_text(encoding="utf-8"))]
    assert found == [], ("comments and docstrings say what and why; dates and runs belong in "
                         "bench/HISTORY.md and commit messages:\n" + "\n".join(found))


def test_the_scan_covers_the_package():
    names = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert "backend_src/specguide/config.py" in names
    assert "backend_src/specguide/kernels/ops.c" in names
    assert len([n for n in names if n.startswith("backend_src/specguide/")]) > 50


def test_only_comments_and_docstrings_are_read():
    source = '''"""Module doc: see bench/HISTORY.md."""
DATE = re.compile(r"2024-01-31")  # a code string: not prose
SAMPLE = {"date": "2000-01-01", "ref": "bench/HISTORY.md"}
LIMIT = 3
"""LIMIT's doc: measured 2026-11-27."""


def f(x="1999-12-31"):
    """Fine: what f does."""
    return f"{x} 2020-02-02"  # measured on 2026-11-27
'''
    found = violations(Path("m.py"), source)
    assert [v.split(": ")[0:2] for v in found] == [
        ["m.py:1", "a reference to bench/HISTORY.md"],
        ["m.py:5", "a date"],
        ["m.py:10", "a date"],
    ], found


def test_json_schema_drafts_and_versions_are_not_dates():
    assert violations(Path("m.py"), "# draft 2020-12, 2019-09's; r24.10; 12026-11-275\nX = 1\n") == []


def test_c_comments_are_read_and_c_strings_are_not():
    source = ('#define QRB 2 /* faster at 16 rows (bench/HISTORY.md) */\n'
              'static const char *s = "2026-11-27 /* not a comment */";\n'
              '/* one\n * 2026-11-27\n */\n'
              '// RESULTS.md\n')
    found = violations(Path("k.c"), source)
    assert [v.split(": ")[0] for v in found] == ["k.c:1", "k.c:4", "k.c:6"], found
