"""Imports inside backend_src/specguide go one way, down the layers below, and never in a cycle.

Units are the top-level modules and subpackages, and each module of the packages in SPLIT. A unit
may import only units of a strictly lower layer (and its own modules); modules may not import each
other in a cycle. Imports under `if TYPE_CHECKING:` never run, so they do not count (a low layer's
dataclass may name a type of a higher one for its readers and type checkers)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "backend_src" / "specguide"

LAYERS = {
    # plain data, settings and helpers that import nothing of ours
    "request": 0, "config": 0, "engine.step_layout": 0,
    "util.paths": 0, "util.progress": 0, "util.memory": 0, "util.heap": 0, "util.stalls": 0,
    "process.ipc": 0, "process.health_probe": 0, "process.restarts": 0,
    "process.head_training": 1,  # starts `python -m specguide.training.cli` in a process: imports no training code
    "process.engine_protocol": 1,  # the engine process's messages and EngineInfo: plain data over config / request
    "process.engine_handle": 2,  # one engine process and its pipes (starts engine_process_child by name)
    # per-request state (Sequence) and small services every layer above reads
    "engine.sequence_state": 0,  # the non-scheduler parts of a Sequence: plain data (its imports are type-only)
    "engine.block_pool": 0,  # which blocks each slot holds: numpy only
    "engine.step_budget": 0,  # how much of a step prompt chunks take: arithmetic
    "engine.kv_blocks": 1,  # what each running sequence holds in the pool, prefix sharing
    "engine.faults": 1, "tokenizer": 1, "kernels": 1,  # kernels: the C kernels (import nothing of ours)
    "text_stream": 2,  # a request's text from its token events: where the events are read
    "engine.scheduler": 2, "engine.sampler": 2,
    "cuda": 3,  # host functions, and graphs of any step body
    "engine.slot_params": 3,
    "engine.kv_cache": 3,  # in the attention kernel's layout where the kernel serves the model
    "models": 3,
    "guided": 4, "speculative": 4, "engine.step_extras": 4,
    "engine.step": 5,
    "engine.runner": 6,
    "engine.lora_adapters": 6,  # which LoRA adapters are served, resident, held (models.lora's bank)
    "engine.intake": 7, "engine.output_processor": 7,
    "engine.core": 8,  # one iteration and what it owns
    "engine.loop": 9,  # its loop thread and thread-safe API
    "process.engine_process": 10, "training": 10,  # nothing in serving imports training
    "process.engine_process_child": 11,  # the engine process's own side: runs an Engine (engine_process.py starts it by name)
    "triton": 11,
    "openai_api": 12,  # its own process (no model): the Triton interface's checks, over gRPC
    "process.supervisor": 12,  # the CLI that runs and restarts tritonserver: reads model configs as triton/ does
}
# Packages whose modules sit on different layers (the engine's parts interleave with `guided`,
# `speculative` and `models`): each of their modules is a unit of its own.
SPLIT = ("engine", "process", "util")


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join(parts)] = f
    return out


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> 'file:line' of the first such import (lazy ones included, type-only
    ones left out)."""
    mods = _modules()
    edges: dict[tuple[str, str], str] = {}
    for mod, f in mods.items():
        package = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        if mod == "":
            package = []
        tree = ast.parse(f.read_text(), str(f))
        type_only = _type_only(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in type_only:
                continue
            if node.level == 0:
                if not (node.module or "").startswith("specguide"):
                    continue
                base = node.module.split(".")[1:]
            else:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                target = ".".join(base + [alias.name])
                target = target if target in mods else ".".join(base)  # `from .cuda import hostfunc`
                if target and target != mod:
                    edges.setdefault((mod, target), f"{f.relative_to(PACKAGE)}:{node.lineno}")
    return edges


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


def test_every_unit_has_a_layer():
    missing = sorted({_unit(m) for m in _modules() if m and m not in SPLIT} - set(LAYERS))
    assert not missing, f"give these a layer in LAYERS: {missing}"


def test_imports_go_down_the_layers():
    edges = _edges()
    bad = [f"{where}: {src} (layer {LAYERS[_unit(src)]}) imports {dst} (layer {LAYERS[_unit(dst)]})"
           for (src, dst), where in sorted(edges.items())
           if _unit(src) != _unit(dst) and LAYERS[_unit(src)] <= LAYERS[_unit(dst)]]
    print("\n".join(bad))
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules_or_units():
    edges = _edges()
    modules: dict[str, set[str]] = defaultdict(set)
    units: dict[str, set[str]] = defaultdict(set)
    for src, dst in edges:
        modules[src].add(dst)
        if _unit(src) != _unit(dst):
            units[_unit(src)].add(_unit(dst))
    for graph, key in ((modules, str), (units, _unit)):
        cycles = _cycles(graph)
        detail = [f"{c}: " + ", ".join(f"{w} {a} -> {b}" for (a, b), w in sorted(edges.items())
                                      if key(a) in c and key(b) in c and key(a) != key(b))
                  for c in cycles]
        assert not cycles, "import cycles:\n" + "\n".join(detail)
