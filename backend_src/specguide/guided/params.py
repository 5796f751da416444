"""Guided-decoding request parameters: validation, the vLLM `sampling_parameters` keys, choices.

One guide per request. `guide_type` is one of GUIDE_TYPES; `guide` is the schema / regex /
grammar / structural tag, empty for `json` (any JSON value), and a JSON list of strings for
`choice`. Everything a client can get wrong is an InvalidRequestError with a message that says
what is wrong; only the checks that need xgrammar (grammar syntax, schema features) are left to
the compiler.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Optional, Sequence

from ..request import GuidedDecodingParams, InvalidRequestError, UndeclaredKeys
from .limits import check_json_text

BACKENDS = ("xgrammar", "llguidance")  # implementations
BACKEND_NAMES = ("auto",) + BACKENDS + ("guidance",)  # what a request or the server may name
MAX_JSON_WHITESPACE = 8  # longest whitespace run a JSON guide allows between tokens (no loops)


def canonical_backend(name: str, what: str = "guided backend") -> str:
    """'' -> '' (server default), 'guidance' -> 'llguidance', unknown -> ValueError naming it."""
    n = (name or "").strip().lower()
    if n == "guidance":
        return "llguidance"
    if n and n not in BACKEND_NAMES:
        raise ValueError(f"unknown {what} {name!r}; one of {', '.join(BACKEND_NAMES)}")
    return n


GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")

# vLLM StructuredOutputsParams / GuidedDecodingParams fields that select a guide
VLLM_GUIDE_KEYS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")
# vLLM fields that pick or tune a backend: `backend`, `disable_any_whitespace`, `whitespace_pattern`
# are honoured, and `disable_additional_properties: true` (undeclared keys forbidden: the default
# here anyway); SpecGuide adds `strict` (OpenAI strict JSON), `best_effort` (formats nothing can
# check are noted instead of refused), `any_key_order` (listed keys in any order),
# `undeclared_keys` ("forbid" | "allow") and `complete_within_budget` (false: a JSON answer may be
# cut at max_tokens); the rest are vLLM bookkeeping, accepted and ignored
VLLM_OPTION_KEYS = (
    "backend", "disable_any_whitespace", "whitespace_pattern", "strict", "best_effort", "any_key_order",
    "undeclared_keys", "complete_within_budget",
    "_backend", "backend_was_auto", "disable_fallback", "disable_additional_properties", "_backend_was_auto",
)
OPENAI_SCHEMA_KEYS = {"name", "schema", "strict", "description"}  # a response_format json_schema object


def validate_guided(params: GuidedDecodingParams) -> GuidedDecodingParams:
    """Check one guide and return a normalized copy (type lower-cased, JSON guides parsed once)."""
    if not isinstance(params, GuidedDecodingParams):
        raise InvalidRequestError(f"guided decoding parameters must be GuidedDecodingParams, got {type(params).__name__}")
    gtype = (params.guide_type or "").strip().lower() if isinstance(params.guide_type, str) else params.guide_type
    guide = params.guide if params.guide is not None else ""
    if gtype not in GUIDE_TYPES:
        raise InvalidRequestError(f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}; got {params.guide_type!r}")
    if not isinstance(guide, str):
        raise InvalidRequestError(f"guided_decoding_guide must be a string, got {type(guide).__name__}")
    try:
        backend = canonical_backend(params.backend if isinstance(params.backend, str) else str(params.backend))
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    if params.whitespace_pattern and not isinstance(params.whitespace_pattern, str):
        raise InvalidRequestError("whitespace_pattern must be a string")
    out = dataclasses.replace(params, guide_type=gtype, guide=guide, backend=backend,
                              undeclared_keys=undeclared_keys(params.undeclared_keys))
    if gtype == "json":
        if guide.strip():
            raise InvalidRequestError(
                "guide type 'json' (any JSON value) takes no guide; use 'json_schema' to constrain the output by a schema")
        return out
    if not guide.strip():
        raise InvalidRequestError(f"guided_decoding_guide is required (non-empty) for guide type {gtype!r}")
    if gtype == "json_schema":
        parse_json_schema(guide)
    elif gtype == "structural_tag":
        tag = _parse_json(guide, "structural tag")
        if not isinstance(tag, dict):
            raise InvalidRequestError(f"structural tag must be a JSON object, got {type(tag).__name__}")
    elif gtype == "choice":
        check_choices(_parse_json(guide, "choice list"))
    return out


def undeclared_keys(value: Any, what: str = "undeclared_keys") -> UndeclaredKeys:
    """'forbid' | 'allow' (any case) | '' (the server's setting) -> UndeclaredKeys; else an error."""
    if isinstance(value, UndeclaredKeys):
        return value
    try:
        return UndeclaredKeys(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise InvalidRequestError(f"{what} must be 'forbid' or 'allow', got {value!r}") from None


def from_tensors(guide_type: Optional[str], guide: Optional[str]) -> Optional[GuidedDecodingParams]:
    """TensorRT-LLM `guided_decoding_guide_type` / `guided_decoding_guide` -> a guide, or None when absent."""
    gtype = (guide_type or "").strip()
    if not gtype:
        if guide:
            raise InvalidRequestError("guided_decoding_guide is given without guided_decoding_guide_type")
        return None
    return validate_guided(GuidedDecodingParams(gtype, guide or ""))


def from_vllm(value: Any, key: str = "structured_outputs") -> Optional[GuidedDecodingParams]:
    """vLLM `structured_outputs` / `guided_decoding` (a dict or its JSON string) -> a guide or None."""
    if isinstance(value, (bytes, str)):
        value = _parse_json(value, key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{key} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(k for k in value if k not in VLLM_GUIDE_KEYS and k not in VLLM_OPTION_KEYS)
    if unknown:
        raise InvalidRequestError(f"{key}: unknown key(s) {unknown}; a guide is one of {', '.join(VLLM_GUIDE_KEYS)}")
    given = [k for k in VLLM_GUIDE_KEYS if value.get(k) is not None and value.get(k) is not False]
    if len(given) > 1:
        raise InvalidRequestError(f"{key}: give exactly one guide, got {', '.join(given)}")
    if not given:
        return None
    k, v = given[0], value[given[0]]
    opts = _vllm_options(value, key)
    if k == "json":
        parsed = _parse_json(v, f"{key}.json") if isinstance(v, str) else v
        if isinstance(parsed, dict) and "schema" in parsed and set(parsed) <= OPENAI_SCHEMA_KEYS:  # {"name", "schema", "strict"}
            if "strict" in parsed and not isinstance(parsed["strict"], bool):
                raise InvalidRequestError(f"{key}.json.strict must be a boolean, got {parsed['strict']!r}")
            opts["strict"] = opts["strict"] or bool(parsed.get("strict", False))
            v = parsed["schema"]
        if isinstance(v, str):
            return validate_guided(GuidedDecodingParams("json_schema", v, **opts))
        if isinstance(v, (dict, bool)):
            return validate_guided(GuidedDecodingParams("json_schema", json.dumps(v), **opts))
        raise InvalidRequestError(f"{key}.json must be a JSON schema (an object or its JSON string), got {type(v).__name__}")
    if k == "json_object":
        if v is not True:
            raise InvalidRequestError(f"{key}.json_object must be a boolean, got {v!r}")
        return validate_guided(GuidedDecodingParams("json", "", **opts))
    if k == "choice":
        return validate_guided(GuidedDecodingParams(
            "choice", json.dumps(check_choices(v, f"{key}.choice"), ensure_ascii=False), **opts))
    if k == "structural_tag":
        v = json.dumps(v) if isinstance(v, Mapping) else v
    if not isinstance(v, str):
        raise InvalidRequestError(f"{key}.{k} must be a string, got {type(v).__name__}")
    gtype = {"regex": "regex", "grammar": "ebnf_grammar", "structural_tag": "structural_tag"}[k]
    return validate_guided(GuidedDecodingParams(gtype, v, **opts))


def _vllm_options(value: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The honoured option keys of a vLLM structured_outputs dict -> GuidedDecodingParams fields."""
    backend = value.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise InvalidRequestError(f"{key}.backend must be a string, got {type(backend).__name__}")
    for flag in ("disable_any_whitespace", "strict", "best_effort", "any_key_order", "complete_within_budget"):
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            raise InvalidRequestError(f"{key}.{flag} must be a boolean, got {value[flag]!r}")
    ws = value.get("whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise InvalidRequestError(f"{key}.whitespace_pattern must be a string, got {type(ws).__name__}")
    if value.get("disable_additional_properties") not in (None, True, False):
        raise InvalidRequestError(f"{key}.disable_additional_properties must be a boolean, "
                                  f"got {value['disable_additional_properties']!r}")
    keys = undeclared_keys(value.get("undeclared_keys") or "", f"{key}.undeclared_keys")
    if value.get("disable_additional_properties") is True:  # vLLM's name for it (false: no opinion)
        if keys == UndeclaredKeys.ALLOW:
            raise InvalidRequestError(f"{key}: undeclared_keys 'allow' contradicts disable_additional_properties")
        keys = UndeclaredKeys.FORBID
    return dict(backend=backend or "", any_whitespace=not value.get("disable_any_whitespace", False),
                whitespace_pattern=ws or "", strict=bool(value.get("strict", False)),
                best_effort=bool(value.get("best_effort", False)),
                any_key_order=bool(value.get("any_key_order", False)), undeclared_keys=keys,
                complete_within_budget=value.get("complete_within_budget") is not False)


def from_sampling_parameters(params: Mapping[str, Any]) -> Optional[GuidedDecodingParams]:
    """The guide in a vLLM-backend `sampling_parameters` dict (`structured_outputs` or `guided_decoding`)."""
    present = [k for k in ("structured_outputs", "guided_decoding") if params.get(k) is not None]
    if len(present) > 1:
        raise InvalidRequestError("sampling_parameters: give structured_outputs or guided_decoding, not both")
    return from_vllm(params[present[0]], present[0]) if present else None


def resolve_guided(guide_type: Optional[str], guide: Optional[str],
                   sampling_parameters: Optional[Mapping[str, Any]] = None) -> Optional[GuidedDecodingParams]:
    """The request's one guide from the TensorRT-LLM tensors and/or the vLLM JSON; both at once is an error."""
    a = from_tensors(guide_type, guide)
    b = from_sampling_parameters(sampling_parameters) if sampling_parameters else None
    if a is not None and b is not None:
        raise InvalidRequestError("give one guide: guided_decoding_guide_type and sampling_parameters.structured_outputs are both set")
    return a if a is not None else b


def parse_json_schema(text: str) -> Any:
    """A json_schema guide must be JSON and an object or a boolean schema."""
    schema = _parse_json(text, "json_schema guide")
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"json_schema must be a JSON object (or true/false), got {type(schema).__name__}")
    return schema


def check_choices(choices: Any, what: str = "choice") -> list[str]:
    """A choice guide is a non-empty list of strings (duplicates are allowed and harmless)."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidRequestError(f"{what} must be a non-empty list of strings")
    bad = [c for c in choices if not isinstance(c, str)]
    if bad:
        raise InvalidRequestError(f"{what} must be a list of strings; {bad[0]!r} is a {type(bad[0]).__name__}")
    return list(choices)


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """`root ::= "a" | "b"` with every choice escaped as an EBNF string literal."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in check_choices(choices))


def ebnf_literal(text: str) -> str:
    """A double-quoted EBNF (xgrammar / GBNF) literal matching `text` exactly."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# `start:` at a line's start: [^\S\n]* (not \s*) so that no match attempt runs past its own line
# (with \s*, each of n blank lines rescanned all those after it: quadratic in a client's grammar)
_LARK_START = re.compile(r"^[^\S\n]*\??start\s*:", re.MULTILINE)


def looks_like_lark(grammar: str) -> bool:
    """True for a Lark grammar (vLLM accepts Lark in `grammar`): a `start:` rule and no `::=`."""
    return "::=" not in grammar and _LARK_START.search(grammar) is not None


def normalize_structural_tag(tag: dict) -> dict:
    """Legacy `{"structures": [{begin, schema, end}], "triggers": [...]}` -> xgrammar's `format` form."""
    if "format" in tag or "structures" not in tag:
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidRequestError("structural tag: 'structures' and 'triggers' must be lists")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise InvalidRequestError("structural tag: each structure needs 'begin', 'schema' and 'end'")
        tags.append({"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


PARSE_DEPTH = 512  # nesting a guide's JSON text may have to be parsed at all (the guide limits, lower, apply after)


def _parse_json(text: Any, what: str) -> Any:
    """`text` parsed (a clear InvalidRequestError otherwise); nesting past PARSE_DEPTH is refused
    before the parser recurses (a RecursionError is not a client's message)."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise InvalidRequestError(f"{what} is not valid JSON: a {type(text).__name__}, not a string")
    if not isinstance(text, str):
        text = bytes(text).decode("utf-8", "replace")
    return check_json_text(text, what, PARSE_DEPTH, setting=None)
