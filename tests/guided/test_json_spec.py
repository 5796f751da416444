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


# (2) xgrammar strict_mode: every object closed, arrays without items empty (spec mode: undeclared
# keys allowed; generation's default forbids them, issue 33)
@pytest.mark.parametrize("backend", BOTH)
def test_additional_properties_and_untyped_arrays_allowed_unless_false(xgr_service, encode, backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "l": {"type": "array"}}}
    v = verdicts(xgr_service, encode, schema, [({"a": 1, "b": "x"}, True), ({"l": [1, "z", None]}, True)], backend,
                 undeclared_keys="allow")
    assert all(v.values()), v
    closed = dict(schema, additionalProperties=False)
    v = verdicts(xgr_service, encode, closed, [({"a": 1, "b": "x"}, False)], backend, undeclared_keys="allow")
    assert not any(v.values()), v


NESTED = {"type": "object", "properties": {
    "name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    "meta": {"type": "object", "properties": {"v": {"type": "integer"}}, "additionalProperties": True},
    "counts": {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "properties": {"total": {}}},
    "free": {"type": "object"},
}}


@pytest.mark.parametrize("backend", BOTH)
def test_only_declared_keys_are_generated_by_default(xgr_service, encode, backend):
    """Issue 33: objects silent on additionalProperties take their declared keys only (nested ones,
    array items); what a schema states is kept (additionalProperties true, patternProperties keys,
    an object with patternProperties or with no properties at all); `undeclared_keys: allow` is
    JSON Schema's reading."""
    tests = [({"name": "x", "tags": [{"k": "a"}]}, True),
             ({"name": "x", "extra": 1}, False),  # undeclared at the top
             ({"tags": [{"k": "a", "type": "b"}]}, False),  # undeclared in an array item
             ({"meta": {"v": 1, "anything": [1]}}, True),  # additionalProperties: true is honoured
             ({"counts": {"total": 3, "n_a": 1}}, True),  # patternProperties: the object stays as stated
             ({"counts": {"total": 3, "other": 1}}, True),
             ({"free": {"whatever": {"x": 1}}}, True)]  # no properties: a free-form object
    v = verdicts(xgr_service, encode, NESTED, tests, backend)
    assert [v[(i, "compact")] for i in range(len(tests))] == [ok for _, ok in tests]
    assert [v[(i, "spaced")] for i in range(len(tests))] == [ok for _, ok in tests]
    v = verdicts(xgr_service, encode, NESTED, tests, backend, undeclared_keys="allow")
    assert all(v[(i, "compact")] for i in range(len(tests))), v


@pytest.mark.parametrize("backend", BOTH)
def test_declared_keys_only_leaves_composed_objects_open(xgr_service, encode, backend):
    """Keys declared by another subschema of the same instance stay allowed: an allOf's parts, a
    $ref beside properties (and the definition it reaches), anyOf branches beside properties."""
    allof = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                       {"properties": {"b": {"type": "boolean"}}}]}
    refsib = {"$defs": {"B": {"type": "object", "properties": {"a": {"type": "integer"}}}},
              "$ref": "#/$defs/B", "properties": {"c": {"type": "string"}}}
    beside = {"type": "object", "properties": {"a": {"type": "integer"}},
              "anyOf": [{"properties": {"b": {"type": "string"}}}, {"properties": {"c": {"type": "string"}}}]}
    for schema, doc in ((allof, {"a": 1, "b": True}), (refsib, {"a": 1, "c": "x"}), (beside, {"a": 1, "b": "x"})):
        v = verdicts(xgr_service, encode, schema, [(doc, True)], backend)
        assert v[(0, "compact")] and v[(0, "spaced")], (schema, v)


def test_declared_keys_only_is_a_pure_schema_rewrite():
    from specguide.guided.schema import declared_keys_only

    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "object", "properties": {"x": {}}},
                                                               {"type": "null"}]}},
              "$defs": {"Used": {"properties": {"y": {}}}}, "items": {"properties": {"z": {}}}}
    before = json.dumps(schema)
    out = declared_keys_only(schema)
    assert json.dumps(schema) == before  # the input is not changed
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["anyOf"][0]["additionalProperties"] is False  # an alternative closes alone
    assert out["$defs"]["Used"]["additionalProperties"] is False and out["items"]["additionalProperties"] is False
    assert declared_keys_only({"type": "object"}) == {"type": "object"}
    assert declared_keys_only(True) is True


def test_the_server_setting_and_the_request_pick_the_reading(hf_tokenizer, encode):
    """guided_undeclared_keys (the service default) applies to requests that say nothing; a request's
    own undeclared_keys wins; both are part of the compile cache key."""
    from specguide.guided import GrammarCompilerService

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    text = encode('{"a":1,"b":2}')
    svc = GrammarCompilerService(hf_tokenizer, VOCAB, max_workers=1, undeclared_keys="allow")
    try:
        for keys, ok in (("", True), ("forbid", False), ("allow", True)):
            m = svc.submit(G("json_schema", schema, backend="llguidance", undeclared_keys=keys)).result().matcher()
            assert (m.validate(text) == len(text)) == ok, keys
        with pytest.raises(InvalidRequestError, match="undeclared_keys must be 'forbid' or 'allow'"):
            svc.submit(G("json_schema", schema, undeclared_keys="never"))
    finally:
        svc.shutdown()


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
    # xgrammar drops the second part's `required`: the value check at the object's close holds it
    v = verdicts(xgr_service, encode, allof, [({"a": 1, "b": True}, True), ({"a": 1}, False)], backend)
    assert v[(0, "compact")] and v[(0, "spaced")] and not v[(1, "compact")] and not v[(1, "spaced")]


# key order: schema order by default (both libraries; it keeps grammar-forced keys for drafting),
# any order with `any_key_order` (llguidance; `required` and duplicate keys checked at the close)
def test_any_key_order_is_an_opt_in(xgr_service, encode, hf_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "object", "properties": {"x": {}, "y": {}},
                                                     "required": ["x"]}}, "required": ["a", "b"]}
    tests = [({"b": "x", "a": 1}, True), ({"a": 1, "b": "x"}, True), ({"c": {"y": 1, "x": 2}, "b": "", "a": 0}, True),
             ({"a": 1}, False), ({"a": 1, "b": "x", "c": {"y": 1}}, False), ({"b": 1, "a": 1}, False)]
    v = verdicts(xgr_service, encode, schema, tests, "llguidance")
    assert [v[(i, "compact")] for i in range(6)] == [False, True, False, False, False, False]  # schema order
    v = verdicts(xgr_service, encode, schema, tests, "llguidance", any_key_order=True)
    assert v == {(i, f): ok for i, (_, ok) in enumerate(tests) for f in ("compact", "spaced")}, v
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend="auto", any_key_order=True))
    assert guide.backend == "llguidance" and set(guide.checked) == {"required at /", "required at /properties/c"}
    m = guide.matcher()
    assert m.validate(encode('{"a":1,"a":2,"b":"x"}')) < len(encode('{"a":1,"a":2,"b":"x"}'))  # duplicate key
    assert all(m.accept(t) for t in encode('{"a":1'))
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    allowed = [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert not any("}" in hf_tokenizer.decode([t]) for t in allowed)  # "b" is still required
    refs = {"$defs": {"A": {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "string"}}}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/A/properties/p"}, "b": {"type": "string"}},
            "allOf": [{"required": ["a", "b"]}]}  # a $ref into moved properties; `required` in another part
    tests = [({"b": "x", "a": 1}, True), ({"b": "x", "a": "s"}, False), ({"b": "x"}, False)]
    v = verdicts(xgr_service, encode, refs, tests, "llguidance", any_key_order=True)
    assert v == {(i, f): ok for i, (_, ok) in enumerate(tests) for f in ("compact", "spaced")}, v
    with pytest.raises(InvalidRequestError, match="any_key_order needs the llguidance backend"):
        xgr_service.compile(G("json_schema", json.dumps(schema), backend="xgrammar", any_key_order=True))


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
    v = verdicts(xgr_service, encode, pat, [({"x1": 1.5}, False)], "xgrammar")  # no assertion; nothing invalid
    assert not any(v.values())


# (6) nothing invalid accepted silently: what no grammar enforces is checked when its value closes
@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize("schema,tests,where", [
    ({"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}},
     [({"l": [1, 2]}, True), ({"l": [1, 1]}, False), ({"l": [[1], [1]]}, False)], "uniqueItems at /properties/l"),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 10}]}, [(3, True), (12, False), (15.5, True)],
     "oneOf at /"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, [({"a": 1, "b": 2}, True), ({"a": 1}, False), ({"b": 1}, True)],
     "dependencies at /"),
])
def test_unenforceable_keywords_are_checked_when_the_value_closes(xgr_service, encode, backend, schema, tests, where):
    v = verdicts(xgr_service, encode, schema, tests, backend)
    assert v == {(i, f): ok for i, (_, ok) in enumerate(tests) for f in ("compact", "spaced")}, v
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
    assert where in guide.checked and not guide.unenforced, (guide.checked, guide.unenforced)


@pytest.mark.parametrize("backend", BOTH)
def test_invalid_date_rejected(xgr_service, encode, backend):
    schema = {"type": "string", "format": "date"}
    v = verdicts(xgr_service, encode, schema, [("2024-02-28", True), ("2024-02-30", False)], backend)
    assert v == {(0, "compact"): True, (0, "spaced"): True, (1, "compact"): False, (1, "spaced"): False}


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
        {"schema": {"type": "string", "format": "uri-reference"}, "tests": [{"data": "a", "valid": True}]},
    ]
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in cases) + "\n")
    proc = subprocess.run([sys.executable, "-m", "specguide.guided", "check", "--cases", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["id"] for x in lines] == ["obj", 2, 3, 4]
    obj, uniq, date, uri = lines
    assert obj["backend"] == "llguidance" and obj["compiled"] and obj["note"] == "kept"
    assert obj["tests"][0]["compact"] == {"valid": True, "accepted": True, "rejected_at": None}
    assert obj["tests"][1]["spaced"]["accepted"] is False and obj["tests"][1]["spaced"]["rejected_at"] > 0
    assert obj["mask_us_p50"] > 0 and obj["mask_us_p99"] >= obj["mask_us_p50"] and obj["compile_ms"] > 0
    assert uniq["compiled"] and uniq["tests"][0]["compact"] == {"valid": False, "accepted": False, "rejected_at": 4}
    assert date["compiled"] and date["tests"][0]["compact"]["accepted"] is False
    assert not uri["compiled"] and "format uri-reference at /" in uri["error"]
    assert "4 cases: 3 passing (both forms), 0 invalid" in proc.stderr


# value-close checks: a closing token that fails is rejected and masked out, the sampler goes on
@pytest.mark.parametrize("backend", BOTH)
def test_a_closing_token_that_fails_is_masked_and_another_way_on_is_open(xgr_service, encode, hf_tokenizer, backend):
    schema = {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["l"]}
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
    m = guide.matcher()
    dup = encode(", 1")
    assert all(m.accept(t) for t in encode('{"l": [1') + dup)
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    allowed = [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and not any("]" in hf_tokenizer.decode([t]) for t in allowed)  # `]`, `]}`, ` ]`: all masked
    assert encode(",")[0] not in allowed and encode("2")[0] in allowed  # the item can still become 12
    close = encode("]")[0]
    assert not m.accept(close) and "non-unique" in m.violation() and "uniqueItems" in m.violation()
    m.rollback(len(dup))
    assert all(m.accept(t) for t in encode(", 2]}")) and m.is_completed()
    stop = xgr_service.stop_token_ids[0]
    assert m.accept(stop) and m.is_terminated()


@pytest.mark.parametrize("backend", BOTH)
def test_unique_items_are_checked_as_each_item_ends(xgr_service, encode, hf_tokenizer, backend):
    """A duplicate item is refused where it ends (its closing quote, the comma after a number), so the
    model can still write another item instead of being stuck with an array that cannot close."""
    schema = {"type": "array", "uniqueItems": True, "items": {"type": ["string", "integer"]}}
    m = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend)).matcher()
    assert all(m.accept(t) for t in encode('["ab", 1, "ab'))
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    allowed = [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert not any(hf_tokenizer.decode([t]).startswith('"') for t in allowed)  # "ab" again: masked
    assert encode("c")[0] in allowed and "non-unique" in (m.violation() or "non-unique")
    assert m.validate(encode('c", 1')) == len(encode('c", 1'))  # "abc" is new; the 1 not yet ended...
    ids = encode('c", 1,')
    assert m.validate(ids) == len(ids) - 1  # ...its comma is refused
    assert m.validate(encode('c", 12]')) == len(encode('c", 12]'))


@pytest.mark.parametrize("backend", BOTH)
def test_the_stop_token_is_masked_while_the_document_is_invalid(xgr_service, encode, backend):
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
    m = guide.matcher()
    assert all(m.accept(t) for t in encode("[1, 2]"))
    stop = xgr_service.stop_token_ids[0]
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    m.fill(mask, 0)
    assert (int(mask[0, stop // 32]) >> (stop % 32)) & 1 and m.is_completed()


def test_nested_checks_never_reject_a_valid_document(xgr_service, encode):
    """A check runs only against subschemas that apply whatever branch is taken: [1, 1] fails the first
    anyOf branch's uniqueItems but is valid through the second; $ref / allOf parts do apply."""
    any_of = {"type": "object", "properties": {"l": {"anyOf": [{"type": "array", "uniqueItems": True},
                                                               {"type": "array", "items": {"type": "integer"}}]}}}
    ref = {"$defs": {"U": {"type": "array", "uniqueItems": True}}, "type": "object",
           "properties": {"l": {"allOf": [{"$ref": "#/$defs/U"}]}, "s": {"type": "string"}}}
    tricky = {"l": [1, 1], "s": 'x"]}[,'}
    for backend in BOTH:
        v = verdicts(xgr_service, encode, any_of, [({"l": [1, 1]}, True), (tricky, True)], backend,
                     undeclared_keys="allow")
        assert all(v.values()), (backend, v)
        v = verdicts(xgr_service, encode, ref, [({"l": [1, 1]}, False), ({"l": [1, 2], "s": tricky["s"]}, True)], backend)
        assert v == {(0, "compact"): False, (0, "spaced"): False, (1, "compact"): True, (1, "spaced"): True}, v
        m = xgr_service.compile(G("json_schema", json.dumps(ref), backend=backend)).matcher()
        ids = encode('{"l": [1, 1]')
        assert m.validate(ids) == len(ids) - 1  # rejected at the `]` that closes the array, not at the end


@pytest.mark.parametrize("backend", BOTH)
def test_formats_nothing_checks_are_refused_unless_best_effort(xgr_service, encode, backend):
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri-reference"},
                                               "l": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(InvalidRequestError, match="can enforce format uri-reference at /properties/u; set best_effort"):
        xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
    guide = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend, best_effort=True))
    assert guide.unenforced == ("format uri-reference at /properties/u",)
    assert "uniqueItems at /properties/l" in guide.checked
    v = verdicts(xgr_service, encode, schema, [({"u": "a", "l": [1]}, True), ({"l": [2, 2]}, False)], backend,
                 best_effort=True)
    assert v == {(0, "compact"): True, (0, "spaced"): True, (1, "compact"): False, (1, "spaced"): False}


def test_a_schema_that_is_not_json_schema_is_refused(xgr_service):
    for backend in BOTH:
        with pytest.raises(InvalidRequestError, match=r"invalid json_schema guide: .*\(at /"):
            xgr_service.compile(G("json_schema", json.dumps({"type": "array", "uniqueItems": True, "description": 5}), backend=backend))


@pytest.mark.parametrize("schema,tests,where", [  # what xgrammar silently accepted on MaskBench
    ({"type": "object", "patternProperties": {"^(?!@@)[a-z@]+$": {"type": "integer"}}},
     [({"ab": 1}, True), ({"ab": "x"}, False)], "pattern lookaround at /"),
    ({"type": "number", "multipleOf": 0.01}, [(0.25, True), (0.005, False)], "multipleOf on numbers at /"),
    ({"type": "object", "properties": {"b": {"type": "object", "enum": ["X"]}}}, [({}, True), ({"b": "X"}, False)],
     "type beside enum at /properties/b"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, [("aa", True), ("aaaa", False)], "maxLength with pattern at /"),
])
def test_xgrammar_blind_spots_are_value_checked(xgr_service, encode, schema, tests, where):
    v = verdicts(xgr_service, encode, schema, tests, "xgrammar")
    assert v == {(i, f): ok for i, (_, ok) in enumerate(tests) for f in ("compact", "spaced")}, v
    assert where in xgr_service.compile(G("json_schema", json.dumps(schema), backend="xgrammar")).checked


# structural tags on both backends (llguidance: its StructTag, for `triggered_tags` of JSON schemas)
@pytest.mark.parametrize("backend", BOTH)
def test_structural_tags_on_both_backends(xgr_service, encode, backend):
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"begin": "<function=get>", "content": {"type": "json_schema", "json_schema": OBJ}, "end": "</function>"}]}}
    guide = xgr_service.compile(G("structural_tag", json.dumps(tag), backend=backend))
    assert guide.backend == backend
    stop = xgr_service.stop_token_ids[0]

    def ends(text: str) -> bool:
        m = guide.matcher()
        ids = encode(text)
        return m.validate(ids + [stop]) == len(ids) + 1

    assert ends('Sure. <function=get>{"a": 1}</function> Done.') and ends("No call at all.")
    assert ends('<function=get>{"a":2}</function>')
    assert not ends('<function=get>{"a": "x"}</function>')  # the schema holds inside the tag
    assert not ends('<function=put>{"a": 1}</function>')  # after the trigger, only a listed tag
    assert not ends('<function=get>{"a": 1}')  # a tag must end
    once = json.loads(json.dumps(tag))
    once["format"]["at_least_one"] = True
    guide = xgr_service.compile(G("structural_tag", json.dumps(once), backend=backend))
    assert not ends("No call at all.") and ends('<function=get>{"a": 1}</function>')


def test_a_format_under_a_dropped_not_is_not_counted_as_enforced(xgr_service, encode):
    """MaskBench Github_medium---o76785: a `uri` format inside a `not` is neither the lenient grammar's (it
    drops `not`) nor jsonschema's (no rfc3987): refused by default, never accepted unchecked."""
    schema = {"type": "object", "not": {"properties": {"href": {"format": "uri"}, "t": {"enum": ["x"]}},
                                        "required": ["href", "t"]}}
    with pytest.raises(InvalidRequestError, match="can enforce format uri at /not/properties/href"):
        xgr_service.compile(G("json_schema", json.dumps(schema), backend="llguidance"))
    plain = {"type": "object", "properties": {"href": {"type": "string", "format": "uri"}}, "not": {"required": ["x"]}}
    guide = xgr_service.compile(G("json_schema", json.dumps(plain), backend="llguidance"))  # uri: the grammar's
    assert not guide.unenforced
