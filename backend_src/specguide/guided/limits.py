"""Admission limits for guides, measured from the guide text before anything compiles it.

Grammar compile time grows steeply with a schema's optional properties (cubically in xgrammar
0.2.8), its nesting depth and its repetition bounds (`{n,m}`, `maxLength`, `maxItems`). These
checks refuse such guides at once with an INVALID_ARG message that names the limit and the
setting (EngineConfig field = config.pbtxt parameter) that raises it. They are cheap: one pass over
the text for bytes and depth (before any `json.loads`, so a deep guide never reaches Python's
recursion limit), one walk of the parsed schema for properties and bounds.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..request import GuidedDecodingParams, InvalidRequestError

# JSON Schema keywords whose value becomes a repetition bound in the grammar
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# `{n}`, `{n,}`, `{n,m}` in a regex, a schema `pattern` or an EBNF grammar
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# a JSON string, or an unterminated one to the end of the text: possessive, so one pass (no backtracking
# restarts at each quote, which made a run of escaped quotes quadratic)
_STRINGS = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


@dataclass(frozen=True)
class GuideLimits:
    """What a guide may hold. 0 turns a limit off."""

    max_bytes: int = 262144  # guided_max_guide_bytes
    max_properties: int = 1000  # guided_max_schema_properties (all `properties` entries, nested ones too)
    max_depth: int = 64  # guided_max_nesting_depth (JSON nesting of the guide / schema)
    max_repetition: int = 65536  # guided_max_repetition ({n,m} bounds, maxLength, maxItems, ...)

    @classmethod
    def from_config(cls, cfg: Any) -> "GuideLimits":
        return cls(cfg.guided_max_guide_bytes, cfg.guided_max_schema_properties,
                   cfg.guided_max_nesting_depth, cfg.guided_max_repetition)


@dataclass
class GuideSize:
    """What a guide measures; `cost` orders compiles (smaller first)."""

    nbytes: int = 0
    depth: int = 0
    properties: int = 0
    repetition: int = 0

    @property
    def cost(self) -> float:
        return self.nbytes + 64.0 * self.properties ** 2 / 100 + 16.0 * self.depth ** 2 + 4.0 * self.repetition

    def small(self) -> bool:
        """Cheap enough to compile in-process at once (no worker process round trip)."""
        # a length bound costs xgrammar ~0.5-1.5 s the first time it sees that bound (64 .. 1024), so
        # anything past tiny bounds goes through a killable worker
        return self.nbytes <= 8192 and self.properties <= 64 and self.depth <= 12 and self.repetition <= 32


def json_depth(text: str) -> int:
    """Deepest `[`/`{` nesting of a JSON text (strings skipped), without parsing it: linear time."""
    stripped = _STRINGS.sub("", text) if '"' in text else text
    b = np.frombuffer(stripped.encode("utf-8", "surrogatepass"), np.uint8)
    if not b.size:
        return 0
    steps = np.isin(b, _OPEN).astype(np.int32) - np.isin(b, _CLOSE)
    return max(0, int(np.cumsum(steps).max()))


def _too_big(fact: str, limit: int, setting: str) -> InvalidRequestError:
    return InvalidRequestError(f"{fact}; the limit is {limit} (the setting {setting}, an EngineConfig field "
                               f"and config.pbtxt parameter, raises it)")


def check_json_text(text: str, what: str, max_depth: int, setting: str = "guided_max_nesting_depth") -> Any:
    """`json.loads(text)` that refuses nesting deeper than `max_depth` before parsing (no RecursionError)."""
    depth = json_depth(text)
    if max_depth and depth > max_depth:
        raise _too_big(f"{what} is nested {depth} levels deep", max_depth, setting)
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{what} is nested too deeply to parse") from None
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} is not valid JSON: {e}") from None


def check_guide_text(guide_type: Optional[str], guide: Optional[str], limits: GuideLimits) -> None:
    """Bytes and nesting of a raw guide string, before anything parses it."""
    if not guide:
        return
    n = len(guide.encode("utf-8", "surrogatepass"))
    if limits.max_bytes and n > limits.max_bytes:
        raise _too_big(f"the guide (guided_decoding_guide) has {n} bytes", limits.max_bytes, "guided_max_guide_bytes")
    if (guide_type or "").strip().lower() in ("json_schema", "structural_tag", "choice"):
        depth = json_depth(guide)
        if limits.max_depth and depth > limits.max_depth:
            raise _too_big(f"the guide (guided_decoding_guide) is nested {depth} levels deep", limits.max_depth,
                           "guided_max_nesting_depth")


def measure(params: GuidedDecodingParams) -> GuideSize:
    """Bytes, nesting depth, schema properties and the largest repetition bound of one guide."""
    guide = params.guide or ""
    size = GuideSize(nbytes=len(guide.encode("utf-8", "surrogatepass")))
    if params.guide_type in ("json_schema", "structural_tag"):
        size.depth = json_depth(guide)
        try:
            doc = json.loads(guide)
        except (RecursionError, ValueError):
            return size  # validate_guided / the compiler say what is wrong
        _walk(doc, size)
    elif params.guide_type in ("regex", "ebnf_grammar"):
        size.repetition = _max_repeat(guide)
    return size


def _walk(node: Any, size: GuideSize) -> None:
    stack = [node]
    while stack:  # iterative: depth is already bounded, but no recursion anyway
        x = stack.pop()
        if isinstance(x, dict):
            props = x.get("properties")
            if isinstance(props, dict):
                size.properties += len(props)
            for key in _BOUND_KEYS:
                v = x.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e18:
                    size.repetition = max(size.repetition, int(v))
            pattern = x.get("pattern")
            if isinstance(pattern, str):
                size.repetition = max(size.repetition, _max_repeat(pattern))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _max_repeat(text: str) -> int:
    best = 0
    for m in _REPEAT.finditer(text):
        for g in m.groups():
            if g:
                best = max(best, int(g) if len(g) < 19 else 10 ** 18)
    return best


def check_guide(params: GuidedDecodingParams, limits: GuideLimits) -> GuideSize:
    """Refuse a guide past any limit (InvalidRequestError naming it); returns its measurements."""
    check_guide_text(params.guide_type, params.guide, limits)
    size = measure(params)
    if limits.max_properties and size.properties > limits.max_properties:
        raise _too_big(f"the {params.guide_type} guide has {size.properties} object properties (all levels)",
                       limits.max_properties, "guided_max_schema_properties")
    if limits.max_repetition and size.repetition > limits.max_repetition:
        raise _too_big(f"the {params.guide_type} guide has a repetition bound of {size.repetition} "
                       "({n,m}, maxLength, maxItems, ...)", limits.max_repetition, "guided_max_repetition")
    return size
