"""Guided params: TensorRT-LLM tensors and vLLM sampling_parameters -> one validated guide."""
from __future__ import annotations

import json

import pytest

from specguide.guided.params import (
    choice_to_ebnf,
    ebnf_literal,
    from_sampling_parameters,
    from_tensors,
    from_vllm,
    looks_like_lark,
    normalize_structural_tag,
    resolve_guided,
    validate_guided,
)
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("gtype,guide", [
    ("json", ""), ("json_schema", json.dumps(SCHEMA)), ("json_schema", "true"), ("regex", r"\d+"),
    ("ebnf_grammar", 'root ::= "a"'), ("structural_tag", '{"type": "structural_tag", "format": {}}'),
    ("choice", '["a", "b"]'),
])
def test_valid_tensor_guides(gtype, guide):
    assert from_tensors(gtype, guide) == G(gtype, guide)


def test_tensor_guide_type_is_normalized():
    assert from_tensors(" JSON_Schema ", json.dumps(SCHEMA)).guide_type == "json_schema"


def test_absent_guide_is_none():
    assert from_tensors(None, None) is None
    assert from_tensors("", "") is None
    assert from_sampling_parameters({"temperature": 0}) is None
    assert from_vllm({}) is None
    assert resolve_guided(None, None, None) is None


@pytest.mark.parametrize("gtype,guide,msg", [
    ("yaml", "x", "must be one of"),
    ("", "root ::= \"a\"", "without guided_decoding_guide_type"),
    ("regex", "", "required"),
    ("ebnf_grammar", "   ", "required"),
    ("json_schema", "", "required"),
    ("json", '{"type": "object"}', "takes no guide"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("json_schema", '"string"', "JSON object"),
    ("structural_tag", "[]", "JSON object"),
    ("structural_tag", "{", "not valid JSON"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 1]', "list of strings"),
    ("choice", '"a"', "non-empty list"),
    ("choice", "a, b", "not valid JSON"),
])
def test_tensor_errors(gtype, guide, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        from_tensors(gtype, guide)


def test_validate_rejects_non_params_and_non_string_guides():
    with pytest.raises(InvalidRequestError, match="GuidedDecodingParams"):
        validate_guided({"guide_type": "json"})
    with pytest.raises(InvalidRequestError, match="must be a string"):
        validate_guided(G("regex", 5))


@pytest.mark.parametrize("value,expected", [
    ({"json": SCHEMA}, G("json_schema", json.dumps(SCHEMA))),
    ({"json": json.dumps(SCHEMA)}, G("json_schema", json.dumps(SCHEMA))),
    ({"regex": "[ab]+"}, G("regex", "[ab]+")),
    ({"grammar": 'root ::= "x"'}, G("ebnf_grammar", 'root ::= "x"')),
    ({"choice": ["x", "y\""]}, G("choice", '["x", "y\\""]')),
    ({"json_object": True}, G("json", "")),
    ({"json_object": False, "regex": "a"}, G("regex", "a")),
    ({"regex": "a", "json": None, "disable_any_whitespace": True, "backend": "xgrammar"},
     G("regex", "a", backend="xgrammar", any_whitespace=False)),
    ({"json": SCHEMA, "backend": "guidance", "whitespace_pattern": " ?", "best_effort": True},
     G("json_schema", json.dumps(SCHEMA), backend="llguidance", whitespace_pattern=" ?", best_effort=True)),
    ({"json": {"name": "x", "schema": SCHEMA, "strict": True}, "backend": "auto"},  # OpenAI's json_schema object
     G("json_schema", json.dumps(SCHEMA), backend="auto", strict=True)),
    ({"json": SCHEMA, "strict": True}, G("json_schema", json.dumps(SCHEMA), strict=True)),
    ({"json": SCHEMA, "any_key_order": True}, G("json_schema", json.dumps(SCHEMA), any_key_order=True)),
    ({"json": SCHEMA, "undeclared_keys": "Allow"}, G("json_schema", json.dumps(SCHEMA), undeclared_keys="allow")),
    ({"json": SCHEMA, "undeclared_keys": "forbid"}, G("json_schema", json.dumps(SCHEMA), undeclared_keys="forbid")),
    # vLLM's own name: true forbids; false (what a serialized StructuredOutputsParams always sends) is no opinion
    ({"json": SCHEMA, "disable_additional_properties": True},
     G("json_schema", json.dumps(SCHEMA), undeclared_keys="forbid")),
    ({"json": SCHEMA, "disable_additional_properties": False}, G("json_schema", json.dumps(SCHEMA))),
    ({"structural_tag": {"type": "structural_tag", "format": {}}},
     G("structural_tag", '{"type": "structural_tag", "format": {}}')),
])
def test_vllm_mapping(value, expected):
    assert from_vllm(value) == expected
    assert from_vllm(json.dumps(value)) == expected  # the JSON-string form too
    assert from_sampling_parameters({"structured_outputs": value, "temperature": 0.0}) == expected
    assert from_sampling_parameters({"guided_decoding": value}) == expected


@pytest.mark.parametrize("value,msg", [
    ({"json": SCHEMA, "regex": "a"}, "exactly one guide"),
    ({"choice": ["a"], "grammar": "root ::= \"a\""}, "exactly one guide"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "a|b"}, "non-empty list"),
    ({"choice": ["a", None]}, "list of strings"),
    ({"json": 3}, "JSON schema"),
    ({"json": "{bad"}, "not valid JSON"),
    ({"json": "[1]"}, "JSON object"),
    ({"json_object": "yes"}, "boolean"),
    ({"regex": 5}, "must be a string"),
    ({"grammar": ""}, "required"),
    ({"jsn": SCHEMA}, "unknown key"),
    ([1, 2], "JSON object"),
    ("{oops", "not valid JSON"),
    ({"regex": "a", "backend": "outlines"}, "unknown guided backend 'outlines'"),
    ({"regex": "a", "backend": 3}, "backend must be a string"),
    ({"regex": "a", "strict": "yes"}, "strict must be a boolean"),
    ({"json": {"schema": SCHEMA, "strict": 1}}, "strict must be a boolean"),
    ({"regex": "a", "whitespace_pattern": 5}, "whitespace_pattern must be a string"),
    ({"json": SCHEMA, "undeclared_keys": "sometimes"}, "undeclared_keys must be 'forbid' or 'allow'"),
    ({"json": SCHEMA, "undeclared_keys": True}, "undeclared_keys must be 'forbid' or 'allow'"),
    ({"json": SCHEMA, "disable_additional_properties": "yes"}, "disable_additional_properties must be a boolean"),
    ({"json": SCHEMA, "undeclared_keys": "allow", "disable_additional_properties": True}, "contradicts"),
    ({"json": "[" * 20000 + "]" * 20000}, "nested 20000 levels deep; at most 512 are read"),  # not a RecursionError
    ("[" * 5000, "nested 5000 levels deep"),  # the whole structured_outputs value as a string
])
def test_vllm_errors(value, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        from_vllm(value)


def test_several_guides_in_one_request():
    with pytest.raises(InvalidRequestError, match="not both"):
        from_sampling_parameters({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}})
    with pytest.raises(InvalidRequestError, match="give one guide"):
        resolve_guided("regex", "a", {"structured_outputs": {"json_object": True}})
    assert resolve_guided("regex", "a", {"temperature": 0.5}) == G("regex", "a")
    assert resolve_guided(None, None, {"guided_decoding": {"regex": "b"}}) == G("regex", "b")


def test_ebnf_literal_escaping():
    assert ebnf_literal('a"b\\c') == '"a\\"b\\\\c"'
    assert ebnf_literal("x\ny\tz\r\x01é") == '"x\\ny\\tz\\r\\x01é"'
    assert choice_to_ebnf(["C++", "C#"]) == 'root ::= "C++" | "C#"'
    with pytest.raises(InvalidRequestError):
        choice_to_ebnf([])


def test_lark_detection():
    assert looks_like_lark('start: "a" b\nb: "c"')
    assert looks_like_lark('\n?start: x\nx: "1"')
    assert not looks_like_lark('root ::= "a"')
    assert not looks_like_lark('root ::= start\nstart ::= "a"')


def test_legacy_structural_tag_is_converted():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}
    new = normalize_structural_tag(legacy)
    assert new["format"]["type"] == "triggered_tags" and new["format"]["triggers"] == ["<f="]
    assert new["format"]["tags"][0] == {"begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "</f>"}
    assert normalize_structural_tag(new) is new
    with pytest.raises(InvalidRequestError, match="begin"):
        normalize_structural_tag({"structures": [{"begin": "x"}], "triggers": []})
