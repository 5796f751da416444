"""Guided decoding (xgrammar or llguidance): request params, the compile service, the per-slot decoder."""
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
    "GUIDE_TYPES", "CompileHandle", "GrammarCompilerService", "GuidedDecoder", "build_tokenizer_info",
    "choice_to_ebnf", "from_sampling_parameters", "from_tensors", "from_vllm", "resolve_guided", "validate_guided",
]
