"""Guided decoding (xgrammar or llguidance): request params, the compile service, the per-slot decoder."""
from .backend import BACKEND_NAMES, BACKENDS, CompiledGuide, GrammarBackend, Matcher
from .compiler import CompileHandle, GrammarCompilerService, build_tokenizer_info
from .decoder import GuidedDecoder
from .params import (
    GUIDE_TYPES,
    choice_to_ebnf,
    from_sampling_parameters,
    from_tensors,
    from_vllm,
    resolve_guided,
    validate_guided,
)

__all__ = [
    "BACKENDS", "BACKEND_NAMES", "CompiledGuide", "GrammarBackend", "Matcher", "GUIDE_TYPES", "CompileHandle", "GrammarCompilerService", "GuidedDecoder", "build_tokenizer_info",
    "choice_to_ebnf", "from_sampling_parameters", "from_tensors", "from_vllm", "resolve_guided", "validate_guided",
]
