"""One guide compiled by an xgrammar GrammarCompiler, and xgrammar's errors made legible.

No torch here, nor `import xgrammar` at module level: the compile workers (compile_worker.py) use
this module with only xgrammar's compiler loaded, which keeps torch's ~150 MB out of each worker.
"""
from __future__ import annotations

import json
import re
from typing import Any

from ..request import GuidedDecodingParams, InvalidRequestError
from .params import MAX_JSON_WHITESPACE, choice_to_ebnf, looks_like_lark, normalize_structural_tag

# "[02:15:01] /project/cpp/grammar_parser.cc:820: " and "Check failed: (...) is false: "
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")
_CPP_NOISE = re.compile(r"(/\S+\.(cc|h|cpp):\d+:?|Check failed:|Stack trace)")


def xgrammar_message(err: BaseException) -> str:
    """xgrammar's error text without its C++ source location and CHECK boilerplate."""
    text = str(err).strip()
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    if _CPP_NOISE.search(text) or not text:  # an internal assertion: say so, without its source
        return "xgrammar cannot compile this guide (internal check failed); try backend 'llguidance'"
    return text


def compile_guide(compiler: Any, params: GuidedDecodingParams, schema: Any) -> Any:
    """`params` (validated) compiled by `compiler` (an xgrammar GrammarCompiler): a CompiledGrammar.
    `schema` is `schema.json_schema_of(params)`. Raises InvalidRequestError with xgrammar's message."""
    gtype, guide = params.guide_type, params.guide
    try:
        if schema is not None:
            for opt in ("whitespace_pattern", "any_key_order"):
                if getattr(params, opt):
                    raise InvalidRequestError(f"{opt} needs the llguidance backend (xgrammar has no such option)")
            ws = dict(any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE) if params.any_whitespace \
                else dict(any_whitespace=False, separators=(",", ":"))
            return compiler.compile_json_schema(json.dumps(schema), strict_mode=params.strict, **ws)
        if gtype == "regex":
            return compiler.compile_regex(guide)
        if gtype == "ebnf_grammar":
            if looks_like_lark(guide):
                return compiler.compile_lark(guide)
            return compiler.compile_grammar(guide)
        if gtype == "structural_tag":
            tag = normalize_structural_tag(json.loads(guide))
            return compiler.compile_structural_tag(json.dumps(tag))
        if gtype == "choice":
            return compiler.compile_grammar(choice_to_ebnf(json.loads(guide)))
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/TypeError/AssertionError
        raise InvalidRequestError(f"invalid {gtype} guide: {xgrammar_message(e)}") from None
    raise InvalidRequestError(f"unknown guide type {gtype!r}")  # unreachable after validate_guided
