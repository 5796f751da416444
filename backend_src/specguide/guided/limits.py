"""Admission limits for guides, measured from the guide text before anything compiles it.

Grammar compile time grows steeply with a schema's optional properties (cubically in xgrammar
0.2.8), its nesting depth and its repetition bounds (`{n,m}`, `maxLength`, `maxItems`). These
checks refuse such guides at once with an INVALID_ARG message that names the limit and the
setting (EngineConfig field = config.pbtxt parameter) that raises it. They are cheap: one pass over
the text for bytes and depth (before any `json.loads`, so a deep guide never reaches Python's
recursion limit), one walk of the parsed schema for properties and bounds.

`expansion` is what a guide expands to: the largest product of nested repetition bounds, in a
regex or EBNF grammar (`(a{4000}){4000}`: 16M; through rule references too) and in a schema
(minItems x the items' minItems x ... x minLength, through $refs; patterns count as regexes). A
guide's shortest answer, and the automata the token budget builds from it, grow with it, so it is
refused before anything is built (issue 75). Linear in the guide: each token of a regex / rule
body and each schema node is looked at a bounded number of times; products saturate.
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
SATURATED = 1 << 62  # expansion products stop growing here
# what the expansion scan reads in a regex: escapes and character classes whole (an unterminated
# class runs to the end, so no `[` rescans the rest), groups, {n,m} bounds; EBNF adds strings,
# comments and rule names
_BOUND = r"|(?P<rep>\{\s*+(?P<lo>[0-9]++)\s*+(?:,\s*+(?P<hi>[0-9]*+)\s*+)?\})"
_ATOMS = r"(?P<esc>\\.)|(?P<cls>\[\^?\]?(?:\\.|[^\]\\])*+\]?)|(?P<open>\()|(?P<close>\))" + _BOUND
_REGEX_TOKENS = re.compile(_ATOMS, re.S)
_EBNF_TOKENS = re.compile(r'(?P<str>"(?:\\.|[^"\\])*+"?|\'(?:\\.|[^\'\\])*+\'?)|(?P<comment>#[^\n]*+)|'
                          r"(?P<name>[A-Za-z_][\w.-]*+)|" + _ATOMS, re.S)
_RULE = re.compile(r"(?m)^[ \t]*+([A-Za-z_][\w.-]*+)[ \t]*+::=")
_ANY_BOUND = re.compile(r"\{\s*+[0-9]")  # without one, a text expands to 1 (no scan)


@dataclass(frozen=True)
class GuideLimits:
    """What a guide may hold. 0 turns a limit off."""

    max_bytes: int = 262144  # guided_max_guide_bytes
    max_properties: int = 1000  # guided_max_schema_properties (all `properties` entries, nested ones too)
    max_depth: int = 64  # guided_max_nesting_depth (JSON nesting of the guide / schema)
    max_repetition: int = 65536  # guided_max_repetition ({n,m} bounds, maxLength, maxItems, ...)
    max_expansion: int = 1 << 20  # guided_max_expansion (products of nested bounds: GuideSize.expansion)

    @classmethod
    def from_config(cls, cfg: Any) -> "GuideLimits":
        return cls(cfg.guided_max_guide_bytes, cfg.guided_max_schema_properties,
                   cfg.guided_max_nesting_depth, cfg.guided_max_repetition, cfg.guided_max_expansion)


@dataclass
class GuideSize:
    """What a guide measures; `cost` orders compiles (smaller first)."""

    nbytes: int = 0
    depth: int = 0
    properties: int = 0
    repetition: int = 0
    expansion: int = 1  # the largest product of nested repetition bounds (module docstring)

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


def check_json_text(text: str, what: str, max_depth: int,
                    setting: Optional[str] = "guided_max_nesting_depth") -> Any:
    """`json.loads(text)` that refuses nesting deeper than `max_depth` before parsing (no RecursionError);
    `setting`: the one that raises `max_depth` (None: a fixed bound)."""
    depth = json_depth(text)
    if max_depth and depth > max_depth:
        if setting is None:
            raise InvalidRequestError(f"{what} is nested {depth} levels deep; at most {max_depth} are read")
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
    """Bytes, nesting depth, schema properties, the largest repetition bound and what one guide
    expands to (the largest product of nested bounds)."""
    guide = params.guide or ""
    size = GuideSize(nbytes=len(guide.encode("utf-8", "surrogatepass")))
    if params.guide_type in ("json_schema", "structural_tag"):
        size.depth = json_depth(guide)
        try:
            doc = json.loads(guide)
        except (RecursionError, ValueError):
            return size  # validate_guided / the compiler say what is wrong
        _walk(doc, size)
        size.expansion = schema_expansion(doc) if params.guide_type == "json_schema" else _tag_expansion(doc)
    elif params.guide_type in ("regex", "ebnf_grammar"):
        size.repetition = _max_repeat(guide)
        size.expansion = regex_expansion(guide) if params.guide_type == "regex" else ebnf_expansion(guide)
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


def _mul(a: int, b: int) -> int:
    return min(a * b, SATURATED)


def _number(digits: Optional[str]) -> int:
    return (int(digits) if len(digits) < 19 else SATURATED) if digits else 0


def _count(v: Any) -> int:
    """A schema count keyword (minItems, minLength, ...) as 1..SATURATED (1 when absent or not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 1:
        return 1
    return int(v) if v < SATURATED else SATURATED


def _scan(text: str, tokens: re.Pattern, rules: dict[str, int]) -> tuple[int, set[str]]:
    """The largest product of nested repetition bounds in one regex or EBNF rule body (a rule name
    counts as its rule's product, from `rules`; 1 if unknown), and the rule names it uses. A bound
    multiplies the group, class, escape or name right before it (else one character)."""
    stack, last, end, names = [1], 1, -1, set()
    for m in tokens.finditer(text):
        kind = m.lastgroup
        if kind == "rep":
            bound = max(_number(m.group("lo")), _number(m.group("hi")), 1)
            value: Optional[int] = _mul(last if m.start() == end else 1, bound)
        elif kind == "open":
            stack.append(1)
            value = None
        elif kind == "close":
            value = stack.pop() if len(stack) > 1 else 1
        elif kind == "name":
            names.add(m.group())
            value = rules.get(m.group(), 1)
        elif kind == "comment":
            value = None
        else:  # an escape, a class, a string: one item
            value = 1
        if value is not None:
            stack[-1] = max(stack[-1], value)
        last, end = value or 1, m.end()
    return max(stack), names


def regex_expansion(pattern: str) -> int:
    """The largest product of nested repetition bounds of a regex (`(a{4000}){4000}`: 16,000,000)."""
    return _scan(pattern, _REGEX_TOKENS, {})[0] if _ANY_BOUND.search(pattern) else 1


def ebnf_expansion(grammar: str) -> int:
    """The largest product of nested repetition bounds of an EBNF grammar, through its rule
    references (a rule used inside `x{100}` multiplies by 100; a recursive reference counts 1)."""
    if not _ANY_BOUND.search(grammar):
        return 1
    heads = list(_RULE.finditer(grammar))
    if not heads:
        return _scan(grammar, _EBNF_TOKENS, {})[0]
    bodies: dict[str, list[str]] = {}
    for h, nxt in zip(heads, heads[1:] + [None]):
        bodies.setdefault(h.group(1), []).append(grammar[h.end():nxt.start() if nxt else len(grammar)])
    uses = {name: set().union(*(_scan(b, _EBNF_TOKENS, {})[1] for b in texts)) for name, texts in bodies.items()}
    value: dict[str, int] = {}
    state: set[str] = set()  # rules entered (on the path, or done)
    for top in bodies:  # depth first, iteratively: each rule's product after those it uses
        if top in state:
            continue
        state.add(top)
        path = [(top, iter(uses[top]))]
        while path:
            name, todo = path[-1]
            nxt = next((n for n in todo if n in bodies and n not in state), None)
            if nxt is None:
                path.pop()
                value[name] = max(_scan(b, _EBNF_TOKENS, value)[0] for b in bodies[name])
            else:
                state.add(nxt)
                path.append((nxt, iter(uses[nxt])))
    return value["root"] if "root" in value else max(value.values())


def _pointer(root: Any, ref: Any) -> Any:
    """The node a local $ref names (None when it is not one)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: dict, root: Any) -> list[tuple[int, Any]]:
    """(how many times it repeats in its parent's shortest value, subschema) for each subschema."""
    items, props = _count(node.get("minItems")), _count(node.get("minProperties"))
    out: list[tuple[int, Any]] = []
    for key, times in (("items", items), ("additionalItems", items), ("unevaluatedItems", items), ("contains", items),
                       ("additionalProperties", props), ("unevaluatedProperties", props), ("propertyNames", props),
                       ("not", 1), ("if", 1), ("then", 1), ("else", 1)):
        sub = node.get(key)
        if isinstance(sub, dict):
            out.append((times, sub))
        elif key == "items" and isinstance(sub, list):
            out.extend((1, x) for x in sub)
    for key, times in (("anyOf", 1), ("oneOf", 1), ("allOf", 1), ("prefixItems", 1)):
        if isinstance(node.get(key), list):
            out.extend((times, x) for x in node[key])
    for key, times in (("properties", 1), ("patternProperties", props), ("dependentSchemas", 1)):
        if isinstance(node.get(key), dict):
            out.extend((times, x) for x in node[key].values())
    target = _pointer(root, node.get("$ref"))
    if target is not None:
        out.append((1, target))
    return out


def _own(node: dict) -> int:
    """A schema node's own expansion: its minLength, its patterns' products."""
    most = _count(node.get("minLength"))
    if isinstance(node.get("pattern"), str):
        most = max(most, regex_expansion(node["pattern"]))
    if isinstance(node.get("patternProperties"), dict):
        most = max([most] + [regex_expansion(k) for k in node["patternProperties"]])
    return most


def schema_expansion(root: Any) -> int:
    """The largest product of nested bounds in a JSON schema: minItems x the items' ... x minLength
    (or a pattern's product), through $refs (each node once; a recursive $ref counts 1)."""
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, Optional[list[tuple[int, Any]]]]] = [(root, None)]
    while stack:  # depth first, iteratively: each node's product after its subschemas'
        node, kids = stack[-1]
        if kids is None:
            if not isinstance(node, dict) or id(node) in memo or id(node) in on_path:
                stack.pop()
                continue
            kids = _children(node, root)
            stack[-1] = (node, kids)
            on_path.add(id(node))
            stack.extend((sub, None) for _, sub in kids
                         if isinstance(sub, dict) and id(sub) not in memo and id(sub) not in on_path)
        else:
            stack.pop()
            on_path.discard(id(node))
            memo[id(node)] = max([_own(node)] + [_mul(times, memo.get(id(sub), 1)) for times, sub in kids])
    return memo.get(id(root), 1)


def _tag_expansion(doc: Any) -> int:
    """The largest expansion of a structural tag's contents (JSON schemas, regexes, grammars)."""
    most, stack = 1, [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if isinstance(x.get("json_schema"), dict):
                most = max(most, schema_expansion(x["json_schema"]))
            if x.get("type") == "regex" and isinstance(x.get("pattern"), str):
                most = max(most, regex_expansion(x["pattern"]))
            if x.get("type") == "grammar" and isinstance(x.get("grammar"), str):
                most = max(most, ebnf_expansion(x["grammar"]))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return most


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
    if limits.max_expansion and size.expansion > limits.max_expansion:
        raise _too_big(f"the {params.guide_type} guide expands to {size.expansion} repetitions (the product of "
                       "nested repetition bounds: {n,m} inside {n,m}, minItems x minItems x minLength, ...)",
                       limits.max_expansion, "guided_max_expansion")
    return size
