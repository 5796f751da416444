"""The llguidance backend: LLMatcher behind the interface (JSON Schema as the spec means it).

What llguidance cannot enforce (`uniqueItems`, non-disjoint `oneOf`, unknown formats, ...) it
refuses at compile; the schema is then compiled `lenient` (those keywords left out) and they are
checked with jsonschema when their value closes (value_check.py). What neither can check (formats
jsonschema does not know) is refused, naming the keyword and its JSON pointer, unless the request
is `best_effort`: then it is listed on the CompiledGuide as unenforced. A compiled guide is one template LLMatcher; each sequence gets a
deep copy (no second grammar build).
"""
from __future__ import annotations

import functools
import json
import re
import time
from typing import Any, Optional, Sequence

import llguidance as llg
import llguidance.hf
import torch

from ..request import GuidedDecodingParams, InvalidRequestError
from .backend import MAX_JSON_WHITESPACE, CompiledGuide, Encode, GrammarBackend, Matcher
from .params import looks_like_lark, normalize_structural_tag
from .schema import any_key_order, find_keywords, json_schema_of, walk
from .value_check import ValueChecker, ValueCheckedMatcher, checked_validator
from .value_scan import TokenTable

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_JSON_WHITESPACE  # one bounded run
KNOWN_KEYWORDS = ("uniqueItems", "oneOf", "dependencies", "dependentRequired", "dependentSchemas", "format",
                  "if", "then", "else", "not", "contains", "minContains", "maxContains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "allOf", "patternProperties", "pattern",
                  "minProperties", "maxProperties", "$ref", "multipleOf")
# what `lenient` leaves out, and so what the value check looks at (formats included: checked twice
# where llguidance knows them, never zero times)
LENIENT_DROPS = ("uniqueItems", "oneOf", "dependencies", "dependentRequired", "dependentSchemas", "format", "if",
                 "then", "else", "not", "contains", "minContains", "maxContains", "propertyNames",
                 "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties", "pattern",
                 "patternProperties")
# subschemas `lenient` leaves out whole: a format inside them is not the grammar's
LENIENT_BRANCHES = ("not", "if", "then", "else", "dependentSchemas", "dependencies", "contains", "propertyNames",
                    "unevaluatedProperties", "unevaluatedItems")
LLG_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
_QUOTED = re.compile(r'"([^"]+)"')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (.+?)$", re.MULTILINE)


def json_options(params: GuidedDecodingParams) -> dict[str, Any]:
    """llguidance JSON options (`x-guidance`) for a request's whitespace choices."""
    if params.whitespace_pattern:
        return {"whitespace_pattern": params.whitespace_pattern}
    if params.any_whitespace:
        return {"whitespace_pattern": JSON_WHITESPACE}
    return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def locate(schema: Any, message: str) -> list[str]:
    """'keyword at /pointer' for the schema keywords an llguidance error message names."""
    fmt = _UNKNOWN_FORMAT.search(message)
    if fmt:
        return [f"format at {p or '/'}" for p, node in walk(schema) if node.get("format") == fmt.group(1)]
    named = [kw for kw in KNOWN_KEYWORDS if kw in message]
    named += [q for q in _QUOTED.findall(message) if q not in named and q in KNOWN_KEYWORDS]
    for kw in named:  # the most specific first: the keyword the message is about
        found = find_keywords(schema, (kw,))
        if found:
            return found
    return []


def struct_tag_lark(tag: Any, params: GuidedDecodingParams) -> str:
    """An xgrammar structural tag (`triggered_tags` of JSON-schema tags, or the legacy `structures` /
    `triggers` form) as llguidance StructTags: free text until a trigger, then one of the tags that
    begin with it, its JSON, its end, and free text again."""
    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid structural_tag guide: {why}")

    fmt = normalize_structural_tag(tag).get("format") if isinstance(tag, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "triggered_tags":
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        raise refuse(f"the llguidance backend takes `triggered_tags` formats only (format type {kind!r} needs "
                     "backend 'xgrammar' or 'auto')")
    if fmt.get("stop_after_first"):
        raise refuse("stop_after_first needs backend 'xgrammar' or 'auto'")
    triggers, tags = fmt.get("triggers"), fmt.get("tags")
    if not isinstance(triggers, list) or not isinstance(tags, list) or not tags:
        raise refuse("triggered_tags needs a list of triggers and a non-empty list of tags")
    out = []
    for t in tags:
        content = t.get("content") if isinstance(t, dict) else None
        if not isinstance(content, dict) or content.get("type") != "json_schema" or not {"begin", "end"} <= t.keys():
            raise refuse("each tag needs begin, end and a json_schema content on the llguidance backend")
        trig = next((tr for tr in triggers if isinstance(tr, str) and tr and t["begin"].startswith(tr)), None)
        if trig is None:
            raise refuse(f"tag begin {t['begin']!r} starts with none of the triggers")
        schema = content.get("json_schema")
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": json_options(params)}
        out.append(llg.StructTag(trigger=trig, begin=t["begin"], grammar=schema, end=t["end"]))
    lark = llg.StructTag.to_grammar(out, assume_special=False)
    return lark.replace(")* tag_end", ")+ tag_end", 1) if fmt.get("at_least_one") else lark


class LlguidanceMatcher(Matcher):
    """llg.LLMatcher; tokens are validated before they are consumed, so a rejected token
    leaves the state unchanged (LLMatcher's consume on a bad token is a permanent error)."""

    mask_by_position = True

    _executors: dict[int, llg.LLExecutor] = {}

    def __init__(self, m: llg.LLMatcher, stop_ids: frozenset[int]):
        self.m = m
        self.stop_ids = stop_ids
        self.terminated = False  # a stop token was accepted (it can only be the last token)
        self.stop_outside = False  # ...while the matcher was stopped: LLMatcher did not consume it

    def accept(self, token: int) -> bool:
        t = int(token)
        if self.terminated:
            return False
        if self.m.is_stopped():  # the grammar has ended: only a stop token, which LLMatcher does not take
            if t not in self.stop_ids:
                return False
            self.terminated = self.stop_outside = True
            return True
        if self.m.try_consume_tokens([t]) != 1:
            self.check()
            return False
        self.terminated = t in self.stop_ids
        return True

    def check(self) -> None:
        """Raise when llguidance hit one of its limits: the matcher is broken for good (NOTE: its
        mask may allow a token whose consumption then trips a parser limit, e.g. a row of the
        Earley parser past 2000 items for an object with thousands of optional properties)."""
        if self.m.is_error():
            first = (self.m.get_error().strip().splitlines() or ["unknown error"])[0][:300]  # not its dump
            raise InvalidRequestError(f"the guide is too complex for the llguidance backend ({first}); "
                                      "simplify it or use backend 'xgrammar'")

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self.stop_outside:
            n -= 1
        self.terminated = self.stop_outside = False
        if n > 0:
            assert self.m.rollback(n), self.m.get_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        # llguidance.torch.fill_next_token_bitmask without importing llguidance.torch (its
        # @torch.compile loads inductor templates, which fails under Triton's ASCII-locale stub)
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        if k <= 0 or self.terminated:
            return []
        toks = [t for t in self.m.compute_ff_tokens()[:k]]
        return toks[: self.validate(toks)]

    def is_terminated(self) -> bool:
        self.check()
        return self.terminated

    def is_completed(self) -> bool:
        return self.terminated or self.m.is_accepting()

    def reset(self) -> None:
        self.m.reset()
        self.terminated = self.stop_outside = False

    @classmethod
    def fill_many(cls, matchers: list["LlguidanceMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        """All rows in one call on llguidance's thread pool."""
        key = 0 if num_threads == "auto" else int(num_threads)
        ex = cls._executors.get(key)
        if ex is None:
            ex = cls._executors[key] = llg.LLExecutor() if key == 0 else llg.LLExecutor(key)
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous() and bitmask.dim() == 2
        ex.unsafe_compute_mask_ptr([(m.m, r) for m, r in zip(matchers, rows)], bitmask.data_ptr(),
                                   bitmask.shape[1] * 4, bitmask.shape[0])


class LlguidanceBackend(GrammarBackend):
    """One LLTokenizer for one model's tokenizer (llguidance keeps no compile cache; the service does)."""

    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Optional[Sequence[int]] = None):
        if stop_token_ids is None:
            stop_token_ids = [hf_tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(int(t) for t in stop_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(self.stop_ids))

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        t0 = time.perf_counter()
        gtype, schema, order = params.guide_type, None, []
        try:
            if gtype in ("json", "json_schema"):
                schema = json_schema_of(params)
                schema = {} if schema is True else schema
                gschema, order = any_key_order(schema) if params.any_key_order else (schema, [])
                grammar = llg.LLMatcher.grammar_from_json_schema(gschema, defaults=json_options(params))
            elif gtype == "regex":
                grammar = llg.grammar_from("regex", params.guide)
            elif gtype == "choice":
                grammar = llg.grammar_from("choice", params.guide)
            elif gtype == "ebnf_grammar":
                grammar = llg.grammar_from("lark" if looks_like_lark(params.guide) else "ebnf", params.guide)
            elif gtype == "structural_tag":
                grammar = llg.grammar_from("lark", struct_tag_lark(json.loads(params.guide), params))
            else:
                raise InvalidRequestError(f"invalid {gtype} guide: guide type {gtype} needs the xgrammar backend (or 'auto')")
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid {gtype} guide: {e}") from None
        template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error() and schema is None:
            raise InvalidRequestError(f"invalid {gtype} guide: {template.get_error()}")
        if template.is_error() or order:
            return self._value_checked(schema, gschema, params, order, None if template.is_error() else template, t0)
        stop = self.stop_ids
        return CompiledGuide(self.name, self.vocab_size, template, lambda: LlguidanceMatcher(template.deep_copy(), stop),
                             compile_s=time.perf_counter() - t0, schema=schema)

    @functools.cached_property
    def table(self) -> TokenTable:
        tok = self.tokenizer
        return TokenTable([b"" if i in self.stop_ids or tok.is_special_token(i) else tok.decode_bytes([i])
                           for i in range(self.vocab_size)])

    def _value_checked(self, schema: Any, gschema: Any, params: GuidedDecodingParams, flagged: list[str],
                       template: Optional[llg.LLMatcher], t0: float) -> CompiledGuide:
        """`gschema` (the grammar's schema) compiled `lenient` when llguidance refused it (the keywords
        it cannot enforce left out); those keywords and `flagged` checked with jsonschema (against
        `schema`) when their value closes."""
        if template is None:
            grammar = llg.LLMatcher.grammar_from_json_schema(gschema, defaults=json_options(params),
                                                             overrides={"lenient": True})
            template = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():  # not a keyword it lacks: the schema's own fault (or a limit)
                msg = template.get_error()
                where = locate(schema, msg)
                raise InvalidRequestError(f"invalid json_schema guide: {msg}" + (f" ({'; '.join(where[:4])})" if where else ""))
            flagged = flagged + find_keywords(schema, LENIENT_DROPS)
            formats, dropped = LLG_FORMATS, LENIENT_BRANCHES
        else:  # compiled as it is: llguidance enforces every format it took
            formats, dropped = frozenset(n["format"] for _, n in walk(schema) if isinstance(n.get("format"), str)), ()
        validator, blind = checked_validator(schema, params, formats, dropped)
        checker, stop = ValueChecker(schema, validator, flagged, self.table, self.stop_ids), self.stop_ids
        return CompiledGuide(self.name, self.vocab_size, template,
                             lambda: ValueCheckedMatcher(LlguidanceMatcher(template.deep_copy(), stop), checker),
                             compile_s=time.perf_counter() - t0, unenforced=tuple(blind), checked=tuple(flagged),
                             schema=schema)
