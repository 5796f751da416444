"""Issue 33: a JSON answer closes within its budget (guided/budget.py), on the real tokenizer and
both grammar backends, without the model: a rambling "model" that never closes anything still
ends with a valid document and the stop token by max_tokens."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from specguide.guided.budget import SLACK, BudgetMatcher, within_budget
from specguide.guided.json_scanner import Scanner, State
from specguide.guided.regex_completion import Unknown, shortest_match
from specguide.guided.schema_completion import Schemas
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

from .conftest import VOCAB
from .helpers import rambler

BOTH = ["xgrammar", "llguidance"]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 18},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    "bio": {"type": "string"},
    "addr": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2},
                                              "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["city", "zip"]}},
    "required": ["name", "age", "addr"]}
NESTED = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}},
                          "required": ["y"]}},
          "type": "object", "properties": {"p": {"$ref": "#/$defs/P"},
                                           "q": {"type": "array", "items": {"$ref": "#/$defs/P"}, "minItems": 2},
                                           "kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
          "required": ["p", "q", "kind"]}
CASES = [
    (PERSON, '{"name":"Bob", "age": 30, "tags": ["x", "y"], "bio": "likes \\"quotes\\"", '
             '"addr": {"city": "Paris", "zip": "75001"}}'),
    (NESTED, '{"p": {"x": -1.5e3, "y": false}, "q": [{"y": true}, {"x": 0, "y": true}], "kind": "beta", '
             '"note": null}'),
    ({"type": "object", "properties": {"_schema": {"type": "string"}, "shader": {"type": "array", "items": {}}},
      "required": ["schema", "shader"]},  # a required key the properties do not declare (JSONSchemaBench has it)
     '{"shader": ["a"], "note": 1, "schema": "x"}'),
    ({"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"k": {"enum": ["alpha", "beta"]}},
                                            "required": ["k"]}, {"type": "null"}]}, "minItems": 2},
     '[{"k": "beta"}, null, {"k":"alpha"}]'),
    # issue 80: branches that all start with `{` (each followed; the const drops the other), its keys first
    ({"type": "object", "properties": {"note": {"type": "string"}},
      "oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind", "x"]},
                {"properties": {"kind": {"const": "b"}, "y": {"type": "string", "minLength": 2}},
                 "required": ["kind", "y"]}]},
     '{"kind": "b", "y": "hello", "note": "n"}'),
    # an allOf's part before the branches: its keys first
    ({"allOf": [{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
                {"anyOf": [{"properties": {"k": {"const": 1}}, "required": ["k"]},
                           {"properties": {"j": {"type": "array", "items": {"type": "integer"}, "minItems": 1}},
                            "required": ["j"]}]}]},
     '{"name": "x", "j": [2, 3]}'),
    # keys a pattern names; a pattern string with a minLength; a format half written
    ({"type": "object", "patternProperties": {"^[0-9]+$": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z][a-z0-9]*$", "minLength": 3},
        "at": {"type": "string", "format": "date-time"}}, "required": ["id", "at"]}},
      "additionalProperties": False},
     '{"12": {"id": "ab12", "at": "2024-02-29T10:30:00Z"}, "7": {"id": "xyz", "at": "1999-12-31T23:59:59+01:00"}}'),
]


@pytest.mark.parametrize("schema, doc", CASES)
def test_every_prefix_of_a_valid_document_has_a_valid_shortest_end(schema, doc):
    """At each byte of a valid document, the scanner's completion (where it can tell) makes the
    prefix a document that validates; and the shortest document validates."""
    sc = Scanner(Schemas(schema))
    jsonschema.validate(json.loads(sc.completion(State())), schema)
    st, told = State(), 0
    for i in range(len(doc)):
        st = sc.feed(st, doc[i].encode())
        try:
            end = sc.completion(st)
        except Unknown:
            continue
        told += 1
        jsonschema.validate(json.loads(doc[: i + 1] + end), schema)
        walk, text = st, doc[: i + 1]  # the budget forces the completion's first token, then the next one's:
        while rest := sc.completion(walk):  # byte by byte that way, the document still ends, about as soon
            assert len(text) < i + 1 + 2 * len(end) + 4, (doc[: i + 1], end, text)
            walk, text = sc.feed(walk, rest[0].encode()), text + rest[0]
        jsonschema.validate(json.loads(text), schema)
    assert st.done and told == len(doc)  # a half-written `pattern` string included


@pytest.mark.parametrize("schema, doc", CASES)
@pytest.mark.parametrize("width", [2, 3, 5, 8])
def test_bytes_fed_in_tokens_and_memoized_ends_match_byte_by_byte(schema, doc, width):
    """Feeding a token's bytes at once (a string's run up to its quote in one step) reaches the
    state byte-by-byte feeding does, and the completion a scanner memoized over a whole document
    is a fresh scanner's at every prefix."""
    data = doc.encode()
    warm = Scanner(Schemas(schema))
    st = State()
    for i in range(0, len(data), width):
        st = warm.feed(st, data[i: i + width])
        slow = State()
        for c in data[: i + width]:
            slow = Scanner(Schemas(schema)).feed(slow, bytes([c]))
        assert st == slow, data[: i + width]
        try:
            fresh = Scanner(Schemas(schema)).completion(slow)
        except Unknown:
            with pytest.raises(Unknown):
                warm.completion(st)
            continue
        assert warm.completion(st) == fresh


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("budget", [32, 48, 80])
def test_a_rambling_answer_still_closes_valid_by_max_tokens(xgr_service, hf_tokenizer, backend, budget):
    pick = rambler(hf_tokenizer, VOCAB)
    stop = xgr_service.stop_token_ids[0]
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    for schema in (PERSON, NESTED):
        guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
        wrapped = within_budget(guide, Scanner(Schemas(schema)), budget, xgr_service.token_bytes, encode, stop)
        assert wrapped.budget is not None
        m = wrapped.matcher()
        assert isinstance(m, BudgetMatcher)
        mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        out = []
        while not m.is_terminated():
            assert len(out) < budget, f"no stop token within {budget}: {hf_tokenizer.decode(out)!r}"
            m.fill(mask, 0)
            t = pick(mask)
            assert m.accept(t)
            out.append(t)
        assert out[-1] == stop
        jsonschema.validate(json.loads(hf_tokenizer.decode(out[:-1])), schema)
        assert wrapped.budget.closed(out)  # the rambler never closes on its own
        assert budget - SLACK - 30 <= len(out) <= budget  # it rambled until the budget took over


@pytest.mark.parametrize("backend", BOTH)
def test_forced_tokens_are_the_completion_and_the_state_rolls_back(xgr_service, hf_tokenizer, backend):
    stop = xgr_service.stop_token_ids[0]
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    guide = within_budget(xgr_service.compile(G("json_schema", json.dumps(PERSON), backend=backend)),
                          Scanner(Schemas(PERSON)), 30, xgr_service.token_bytes, encode, stop)
    m = guide.matcher()
    prefix = encode('{"name": "Alexander the Great of Macedon')
    assert all(m.accept(t) for t in prefix)
    forced = m.forced_tokens(encode, 64)  # in the budget's zone: the shortest end, stop token last
    assert forced[-1] == stop
    text = hf_tokenizer.decode(prefix + forced[:-1])
    jsonschema.validate(json.loads(text), PERSON)
    assert m.validate(forced) == len(forced)
    n = len(prefix)
    m.rollback(n)
    assert m.forced_tokens(encode, 64) != forced and len(m.states) == 1


def test_a_budget_below_the_shortest_document_is_refused_naming_both(xgr_service, hf_tokenizer):
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    guide = xgr_service.compile(G("json_schema", json.dumps(PERSON)))
    shortest = len(encode(Schemas(PERSON).shortest(PERSON)))  # its text; the stop token may not fit
    with pytest.raises(InvalidRequestError, match=f"max_tokens {shortest - 1} cannot hold .* takes {shortest} tokens$"):
        within_budget(guide, Scanner(Schemas(PERSON)), shortest - 1, xgr_service.token_bytes, encode,
                      xgr_service.stop_token_ids[0])
    args = (xgr_service.token_bytes, encode, xgr_service.stop_token_ids[0])
    assert within_budget(guide, Scanner(Schemas(PERSON)), shortest, *args).budget is None  # no room for the stop
    assert within_budget(guide, Scanner(Schemas(PERSON)), shortest + 1, *args).budget is not None


def test_shortest_values_follow_the_keywords():
    s = Schemas({})
    assert s.shortest({"type": "integer", "minimum": 7, "multipleOf": 5}) == "10"
    assert s.shortest({"type": "integer", "exclusiveMaximum": -3}) == "-4"
    assert s.shortest({"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}) == '"AA-0"'
    assert s.shortest({"type": "string", "format": "date"}) == '"2000-01-01"'
    assert s.shortest({"enum": ["long one", 3, "ab"]}) == "3"
    assert s.shortest({"type": ["string", "null"], "minLength": 5}) == "null"
    assert s.shortest({"type": "array", "items": {"type": "boolean"}, "minItems": 2}) == "[true,true]"
    assert s.shortest({"type": "object", "properties": {"b": {}, "a": {"type": "string"}}, "required": ["a"],
                       "minProperties": 2}) == '{"b":0,"a":""}'  # keys in the schema's order
    iglu = "^iglu:[a-zA-Z0-9-_.]+/[a-zA-Z0-9-_]+/[a-zA-Z0-9-_]+/[0-9]+-[0-9]+-[0-9]+$"  # Snowplow's
    assert shortest_match(iglu) == "iglu:a/a/a/0-0-0"
    assert shortest_match(iglu, "iglu:com.acme-2018") == "/a/a/0-0-0"  # half written: the rest
    assert shortest_match("^a(b|cd)*e$", "acd") == "e" and shortest_match("[0-9]{3}", "x") == "000"
    with pytest.raises(Unknown):
        shortest_match("^[0-9]{5}$", "12a")  # a prefix the pattern cannot take
    with pytest.raises(Unknown):
        Schemas({"$ref": "#/$defs/L", "$defs": {"L": {"type": "object", "properties": {"n": {"$ref": "#/$defs/L"}},
                                                     "required": ["n"]}}}).shortest({"$ref": "#/$defs/L"})


@pytest.mark.parametrize("backend", BOTH)
def test_a_regex_answer_closes_within_max_tokens_too(xgr_service, hf_tokenizer, backend):
    """A regex guide (the whole answer matches): a rambler inside `[a-z ]+` still ends with a match
    and the stop token by the budget; the shortest end of a half-written match is the NFA's."""
    from specguide.guided.regex_completion import RegexScanner

    pattern = r"Name: [A-Za-z ]+\. Phone: [0-9]{3}-[0-9]{4}\."
    pick, stop = rambler(hf_tokenizer, VOCAB), xgr_service.stop_token_ids[0]
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    sc = RegexScanner(pattern)
    assert sc.completion(sc.feed(sc.start(), b"Name: Ada")) == ". Phone: 000-0000."
    guide = within_budget(xgr_service.compile(G("regex", pattern, backend=backend)), lambda: RegexScanner(pattern),
                          40, xgr_service.token_bytes, encode, stop)
    m, out = guide.matcher(), []
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    while not m.is_terminated():
        assert len(out) < 40, hf_tokenizer.decode(out)
        m.fill(mask, 0)
        out.append(pick(mask))
        assert m.accept(out[-1])
    text = hf_tokenizer.decode(out[:-1])
    assert re.fullmatch(pattern, text) and guide.budget.closed(out), text


# ------------------------------------------------------------------------------ tool calls (structural tags)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                     "days": {"type": "array", "items": {"type": "integer"}}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 2}}, "required": ["city"]}}}


def _tool_tag(choice, parallel=True):
    from specguide.openai_api.schemas import NamedToolChoice, Tool, ToolChoiceMode
    from specguide.openai_api.tools import tool_guide

    c = NamedToolChoice.model_validate(choice) if isinstance(choice, dict) else ToolChoiceMode(choice)
    return tool_guide([Tool.model_validate(WEATHER), Tool.model_validate(TIME)], c, parallel)


def _calls(text):
    from specguide.openai_api.tools import parse_all

    content, calls = parse_all(text)
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name]["function"]["parameters"])
    return content, calls


@pytest.mark.parametrize("choice, text", [
    ("required", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 22]}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": { "city" : "Rome"}}\n</tool_call>'),
    ({"type": "function", "function": {"name": "get_time"}},
     '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("auto", 'Let me see. <tool_call>\n{"name": "get_time", "arguments": {"city": "Lima"}}\n</tool_call> Done <tool'),
])
def test_every_prefix_of_tool_calls_has_a_valid_shortest_end(xgr_service, hf_tokenizer, choice, text):
    """At each byte of a valid tool-call output, the scanner's completion (where it can tell: not in
    free text) makes the prefix an output the grammar ends on, with arguments valid for their tool."""
    from specguide.guided.tag_completion import Phase, TagScanner

    xgr = pytest.importorskip("xgrammar")
    tag = _tool_tag(choice)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n", "<eos>"], stop_token_ids=[96])
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(tag))
    sc = TagScanner(tag, xgr_service.token_bytes, lambda s: hf_tokenizer.encode(s, add_special_tokens=False))
    st, told = sc.start(), 0
    for i in range(len(text) + 1):
        if i:
            st = sc.feed(st, text[i - 1].encode())
        try:
            end = sc.completion(st)
        except Unknown:
            assert st.phase == Phase.TEXT
            continue
        told += 1
        m = xgr.GrammarMatcher(grammar)
        assert m.accept_string(text[:i] + end) and m.accept_token(96), (text[:i], end)
        _calls(text[:i] + end)
        walk, out = st, text[:i]  # followed byte by byte (as the budget forces it), it still ends
        while rest := sc.completion(walk):
            assert len(out) < i + 2 * len(end) + 4, (text[:i], end, out)
            walk, out = sc.feed(walk, rest[0].encode()), out + rest[0]
        _calls(out)
    assert told > len(text) // 2


@pytest.mark.parametrize("backend", ["xgrammar"])
@pytest.mark.parametrize("choice, budget", [("required", 64), ("required", 150),
                                            ({"type": "function", "function": {"name": "get_weather"}}, 40)])
def test_rambling_tool_calls_still_close_valid_by_max_tokens(xgr_service, hf_tokenizer, backend, choice, budget):
    """A 'model' that never closes a value and, between calls, always starts another (the default
    model under `tool_choice: required` repeats calls so) ends with whole, valid calls and the stop
    token by max_tokens: the budget ends the output where no further call could fit."""
    from specguide.guided.tag_completion import TagScanner

    pick, stop = rambler(hf_tokenizer, VOCAB), xgr_service.stop_token_ids[0]
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    tag = _tool_tag(choice)
    guide = within_budget(xgr_service.compile(G("structural_tag", json.dumps(tag), backend=backend)),
                          lambda: TagScanner(tag, xgr_service.token_bytes, encode), budget, xgr_service.token_bytes,
                          encode, stop)
    assert guide.budget is not None
    m, out = guide.matcher(), []
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    while not m.is_terminated():
        assert len(out) < budget, hf_tokenizer.decode(out)
        m.fill(mask, 0)
        words = mask[0].numpy().view(np.uint32)
        allowed = np.flatnonzero((words[np.arange(VOCAB) >> 5] >> (np.arange(VOCAB) & 31).astype(np.uint32)) & 1)
        t = pick(mask)
        if t == stop and len(allowed) > 1:  # never stop of its own accord while anything else is allowed
            t = int(next(a for a in allowed if a != stop))
        assert m.accept(t)
        out.append(t)
    assert out[-1] == stop and guide.budget.closed(out)
    content, calls = _calls(hf_tokenizer.decode(out[:-1]))
    assert content is None and calls
    assert isinstance(choice, str) or [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("backend", BOTH)
def test_auto_tools_leave_free_text_alone_and_finish_a_late_call(xgr_service, hf_tokenizer, backend):
    """`tool_choice: auto`: the budget never ends free text early (it runs to max_tokens), but a call
    that begins near the end is finished, valid, within max_tokens."""
    from specguide.guided.tag_completion import TagScanner

    stop, pick = xgr_service.stop_token_ids[0], rambler(hf_tokenizer, VOCAB)
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    tag, budget = _tool_tag("auto"), 60
    guide = within_budget(xgr_service.compile(G("structural_tag", json.dumps(tag), backend=backend)),
                          lambda: TagScanner(tag, xgr_service.token_bytes, encode), budget, xgr_service.token_bytes,
                          encode, stop)
    assert guide.budget is not None
    text = encode("The weather is " + "very " * (budget - 5))[:budget]
    m = guide.matcher()
    assert all(m.accept(t) for t in text) and m.forced_tokens(encode, 4) != [stop]  # no early end in text
    for left in (40, 50):  # a call begins with about `left` tokens of the budget left (a call takes ~25)
        m, out = guide.matcher(), encode("Let me check " + "it " * 40)[:budget - left] + encode("<tool_call>")
        assert all(m.accept(t) for t in out)
        mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        while not m.is_terminated():
            assert len(out) < budget, hf_tokenizer.decode(out)
            m.fill(mask, 0)
            out.append(pick(mask))
            assert m.accept(out[-1])
        content, calls = _calls(hf_tokenizer.decode(out[:-1]))
        assert out[-1] == stop and guide.budget.closed(out) and len(calls) == 1 and content.startswith("Let me check")
