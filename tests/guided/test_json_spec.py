"""JSON Schema as the spec means it (issue 23): one test per MaskBench failure class, per backend,
walked through the engine's own matcher code (guided/check.py), plus the check tool and routing."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specguide.guided.check import check_case
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

from .conftest import VOCAB

BOTH = ["xgrammar", "llguidance"]
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def encode(hf_tokenizer):
    return lambda text: hf_tokenizer.encode(text, add_special_tokens=False)


def verdicts(xgr_service, encode, schema, tests, backend, **params):
    """{(instance index, form): accepted} for `tests` [(data, valid)]; raises if it does not compile."""
    r = check_case(xgr_service, encode, {"schema": schema, "tests": [{"data": d, "valid": v} for d, v in tests]},
                   "t", backend, params=params)
    assert r.compiled, r.error
    assert r.backend == backend
    return {(i, f): w["accepted"] for i, t in enumerate(r.tests) for f, w in t.items()}


# (1) whitespace: compact JSON was rejected (separators ", " / ": " only)
@pytest.mark.parametrize("backend", BOTH)
def test_compact_and_spaced_json_both_accepted(xgr_service, encode, backend):
    v = verdicts(xgr_service, encode, OBJ, [({"a": 1}, True), ({"a": "x"}, False)], backend)
    assert v == {(0, "compact"): True, (0, "spaced"): True, (1, "compact"): False, (1, "spaced"): False}


@pytest.mark.parametrize("backend", BOTH)
def test_whitespace_runs_are_bounded_and_compact_only_is_an_option(xgr_service, hf_tokenizer, backend):
    guide = xgr_service.compile(G("json_schema", json.dumps(OBJ), backend=backend))
    m = guide.matcher()
    ids = hf_tokenizer.encode('{"a":' + " " * 40, add_special_tokens=False)
    assert sum(1 for t in ids if m.accept(t)) < len(ids)  # no endless whitespace
    compact = xgr_service.compile(G("json_schema", json.dumps(OBJ), backend=backend, any_whitespace=False))
    m = compact.matcher()
    assert not all(m.accept(t) for t in hf_tokenizer.encode('{"a": 1}', add_special_tokens=False))


# (2) xgrammar strict_mode: every object closed, arrays without items empty
@pytest.mark.parametrize("backend", BOTH)
def test_additional_properties_and_untyped_arrays_allowed_unless_false(xgr_service, encode, backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "l": {"type": "array"}}}
    v = verdicts(xgr_service, encode, schema, [({"a": 1, "b": "x"}, True), ({"l": [1, "z", None]}, True)], backend)
    assert all(v.values()), v
    closed = dict(schema, additionalProperties=False)
    v = verdicts(xgr_service, encode, closed, [({"a": 1, "b": "x"}, False)], backend)
    assert not any(v.values()), v


@pytest.mark.parametrize("backend", BOTH)
def test_openai_strict_is_an_opt_in(xgr_service, encode, backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    v = verdicts(xgr_service, encode, schema, [({"a": 1}, False), ({"a": 1, "b": "x", "c": 0}, False),
                                                ({"a": 1, "b": "x"}, True)], backend, strict=True)
    assert [v[(i, "compact")] for i in range(3)] == [False, False, True]


# (3) escapes inside strings with minLength / maxLength (xgrammar rejects them: llguidance only)
@pytest.mark.parametrize("backend", ["llguidance", "auto"])
def test_escaped_quote_in_a_length_bounded_string(xgr_service, encode, backend):
    schema = {"type": "string", "minLength": 2, "maxLength": 5}
    r = check_case(xgr_service, encode, {"schema": schema, "tests": [{"data": 'a"b', "valid": True},
                                                                      {"data": 'a"bcde', "valid": False}]}, 0, backend)
    assert r.backend == "llguidance" and r.passing, r.tests


# (4) composed objects: $ref with sibling properties, allOf
@pytest.mark.parametrize("backend", BOTH)
def test_ref_with_sibling_properties_and_allof(xgr_service, encode, backend):
    refsib = {"$defs": {"B": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
              "$ref": "#/$defs/B", "properties": {"c": {"type": "string"}}, "required": ["c"]}
    v = verdicts(xgr_service, encode, refsib, [({"a": 1, "c": "x"}, True), ({"c": "x"}, False)], backend)
    assert v[(0, "compact")] and v[(0, "spaced")] and not v[(1, "compact")]
    allof = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                       {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    if backend == "xgrammar":  # xgrammar would accept {"a": 1} (the second part's `required` dropped)
        with pytest.raises(InvalidRequestError, match="xgrammar cannot enforce allOf at /"):
            xgr_service.compile(G("json_schema", json.dumps(allof), backend=backend))
        return
    v = verdicts(xgr_service, encode, allof, [({"a": 1, "b": True}, True), ({"a": 1}, False)], backend)
    assert v[(0, "compact")] and v[(0, "spaced")] and not v[(1, "compact")]


# (5) compile failures: patternProperties with oneOf values, int64 maximum, the `false` schema
def test_former_compile_failures(xgr_service, encode):
    pat = {"type": "object", "patternProperties": {"^x": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}}
    v = verdicts(xgr_service, encode, pat, [({"x1": 1}, True), ({"x1": "s"}, True), ({"x1": 1.5}, False)], "llguidance")
    assert [v[(i, "compact")] for i in range(3)] == [True, True, False]
    for backend in BOTH:
        big = {"type": "integer", "maximum": 9223372036854775807}
        assert verdicts(xgr_service, encode, big, [(5, True)], backend)[(0, "compact")]
        with pytest.raises(InvalidRequestError, match="the schema is `false`"):
            xgr_service.compile(G("json_schema", "false", backend=backend))
    with pytest.raises(InvalidRequestError, match=r"xgrammar cannot enforce oneOf at /patternProperties/\^x"):
        xgr_service.compile(G("json_schema", json.dumps(pat), backend="xgrammar"))


# (6) nothing invalid accepted silently: refused with keyword + pointer, or enforced
@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}, "uniqueItems at /properties/l"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies at /"),
])
def test_unenforceable_keywords_are_refused(xgr_service, backend, schema, where):
    with pytest.raises(InvalidRequestError, match="invalid json_schema guide") as e:
        xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
    assert where in str(e.value)


def test_invalid_date_rejected_or_refused(xgr_service, encode):
    schema = {"type": "string", "format": "date"}
    v = verdicts(xgr_service, encode, schema, [("2024-02-28", True), ("2024-02-30", False)], "llguidance")
    assert v == {(0, "compact"): True, (0, "spaced"): True, (1, "compact"): False, (1, "spaced"): False}
    with pytest.raises(InvalidRequestError, match="format at /"):
        xgr_service.compile(G("json_schema", json.dumps(schema), backend="xgrammar"))


@pytest.mark.parametrize("backend", BOTH)
def test_best_effort_compiles_and_lists_what_it_leaves_unchecked(xgr_service, backend):
    schema = {"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend, best_effort=True))
    assert guide.backend == backend and any("uniqueItems" in u for u in guide.unenforced), guide.unenforced


# routing and the cache
def test_auto_routes_and_the_cache_key_holds_the_backend(xgr_service):
    schema = json.dumps(OBJ)
    assert xgr_service.backend_for(G("json_schema", schema, backend="auto")) == "llguidance"
    assert xgr_service.backend_for(G("ebnf_grammar", 'root ::= "a"', backend="auto")) == "xgrammar"
    assert xgr_service.backend_for(G("structural_tag", "{}", backend="auto")) == "xgrammar"
    assert xgr_service.backend_for(G("json_schema", schema)) == "xgrammar"  # this service's default
    a = xgr_service.compile(G("json_schema", schema, backend="guidance"))
    b = xgr_service.compile(G("json_schema", schema, backend="xgrammar"))
    assert (a.backend, b.backend) == ("llguidance", "xgrammar")
    assert xgr_service.compile(G("json_schema", schema, backend="llguidance")) is a  # cached per backend
    with pytest.raises(InvalidRequestError, match="unknown guided backend 'outlines'"):
        xgr_service.submit(G("json_schema", schema, backend="outlines"))


def test_check_tool_on_a_small_jsonl(tmp_path):
    cases = [
        {"id": "obj", "schema": OBJ, "tests": [{"data": {"a": 1}, "valid": True}, {"data": {"a": "x"}, "valid": False}],
         "note": "kept"},
        {"schema": {"type": "array", "uniqueItems": True}, "tests": [{"data": [1, 1], "valid": False}]},
        {"schema": {"type": "string", "format": "date"}, "tests": [{"data": "2024-02-30", "valid": False}]},
    ]
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in cases) + "\n")
    proc = subprocess.run([sys.executable, "-m", "specguide.guided", "check", "--cases", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["id"] for x in lines] == ["obj", 2, 3]
    obj, uniq, date = lines
    assert obj["backend"] == "llguidance" and obj["compiled"] and obj["note"] == "kept"
    assert obj["tests"][0]["compact"] == {"valid": True, "accepted": True, "rejected_at": None}
    assert obj["tests"][1]["spaced"]["accepted"] is False and obj["tests"][1]["spaced"]["rejected_at"] > 0
    assert obj["mask_us_p50"] > 0 and obj["mask_us_p99"] >= obj["mask_us_p50"] and obj["compile_ms"] > 0
    assert not uniq["compiled"] and "uniqueItems" in uniq["error"]
    assert date["compiled"] and date["tests"][0]["compact"]["accepted"] is False
    assert "3 cases: 2 passing (both forms), 0 invalid" in proc.stderr


# best effort: value-close checks (jsonschema when the value closes; its stop token rejected)
@pytest.mark.parametrize("backend", BOTH)
def test_best_effort_checks_the_value_when_it_closes(xgr_service, encode, backend):
    schema = {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["l"]}
    v = verdicts(xgr_service, encode, schema, [({"l": [1, 2]}, True), ({"l": [1, 1]}, False)], backend,
                 best_effort=True)
    assert v == {(0, "compact"): True, (0, "spaced"): True, (1, "compact"): False, (1, "spaced"): False}
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend, best_effort=True))
    m = guide.matcher()
    ids = encode('{"l": [1, 1]}')
    assert all(m.accept(t) for t in ids) and not m.is_completed()
    assert "non-unique" in m.violation() and "uniqueItems" in m.violation()
    stop = xgr_service.stop_token_ids[0]
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    assert not (int(mask[0, stop // 32]) >> (stop % 32)) & 1  # the stop token is masked out
    assert not m.accept(stop) and not m.is_terminated()
    m.rollback(len(ids))
    assert all(m.accept(t) for t in encode('{"l": [1') + encode(", 2]}")) and m.accept(stop) and m.is_terminated()


def test_best_effort_date_and_oneof_on_llguidance(xgr_service, encode):
    one = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 10}]}  # 12 matches both
    v = verdicts(xgr_service, encode, one, [(3, True), (12, False), (15.5, True)], "llguidance", best_effort=True)
    assert [v[(i, "compact")] for i in range(3)] == [True, False, True]


@pytest.mark.parametrize("backend", BOTH)
def test_best_effort_refuses_what_neither_grammar_nor_value_check_can_enforce(xgr_service, backend):
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri-reference"}}}
    with pytest.raises(InvalidRequestError, match="can enforce format uri-reference at /properties/u"):
        xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend, best_effort=True))


@pytest.mark.parametrize("schema,where", [  # what xgrammar silently accepted on MaskBench
    ({"type": "object", "patternProperties": {"^(?!@@)[a-z@]+$": {"type": "integer"}}}, "pattern lookaround at /"),
    ({"type": "number", "multipleOf": 0.01}, "multipleOf on numbers at /"),
    ({"type": "object", "properties": {"b": {"type": "object", "enum": ["X"]}}}, "type beside enum at /properties/b"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength with pattern at /"),
])
def test_xgrammar_refuses_what_it_would_accept_wrongly(xgr_service, schema, where):
    with pytest.raises(InvalidRequestError, match="xgrammar cannot enforce") as e:
        xgr_service.compile(G("json_schema", json.dumps(schema), backend="xgrammar"))
    assert where in str(e.value)
