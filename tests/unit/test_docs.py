"""The README stays short and its two commands stay the ones CI runs; every page the docs point
at exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_short_and_names_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    block = re.search(r"## Serve and test\n\n```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make serve", "make test"]
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_every_page_the_docs_name_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
    missing = []
    for page in pages:
        for ref in set(re.findall(r"\b((?:docs|bench)/[A-Za-z_-]+\.md)\b", page.read_text())):
            if not (ROOT / ref).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {ref}")
    assert missing == []
