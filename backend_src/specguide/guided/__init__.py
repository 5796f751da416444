"""Guided decoding (xgrammar or llguidance): request params, the compile service, the per-slot decoder.

Names are loaded on first use: importing a light module of this package (params, limits, schema)
must not pull in torch, xgrammar and llguidance (~280 MB in the Triton stub, which needs none)."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BACKENDS": "params", "BACKEND_NAMES": "params", "GUIDE_TYPES": "params", "choice_to_ebnf": "params",
    "from_sampling_parameters": "params", "from_tensors": "params", "from_vllm": "params",
    "resolve_guided": "params", "validate_guided": "params",
    "CompiledGuide": "backend", "GrammarBackend": "backend", "Matcher": "backend",
    "CompileHandle": "compiler", "GrammarCompilerService": "compiler", "build_tokenizer_info": "xgrammar_backend",
    "GuidedDecoder": "decoder",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
