"""Issue 75: what a guide expands to (the largest product of nested repetition bounds) is
measured in one pass and capped before anything is built (`guided_max_expansion`, guided/limits.py)."""
from __future__ import annotations

import json

import pytest

from specguide.guided.limits import GuideLimits, check_guide, ebnf_expansion, measure, regex_expansion
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

HUGE_REGEX = "(a{4000}){4000}"  # 16,000,000 characters: every bound alone is within guided_max_repetition


def nested_arrays(n: int, depth: int) -> dict:
    """Arrays nested `depth` deep, each with minItems n: the shortest document has n^depth integers."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "minItems": n, "items": schema}
    return schema


NESTED = nested_arrays(1000, 10)


@pytest.mark.parametrize("guide_type, guide, product", [
    ("json_schema", json.dumps(NESTED), 1 << 62),  # 1000^10 saturates at 2^62
    ("regex", HUGE_REGEX, 16_000_000),
    ("ebnf_grammar", 'root ::= item{3000}\nitem ::= "x"{3000}', 9_000_000),  # through a rule reference
    ("json_schema", json.dumps({"$defs": {"A": {"type": "array", "minItems": 2000, "items": {"$ref": "#/$defs/S"}},
                                          "S": {"type": "string", "minLength": 2000}}, "$ref": "#/$defs/A"}),
     4_000_000),  # through $refs
    ("json_schema", json.dumps({"type": "array", "minItems": 200, "items": {"type": "string",
                                                                           "pattern": "^(ab{100}){100}$"}}), 2_000_000),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>", "content": {"type": "json_schema", "json_schema": NESTED}}}),
     1 << 62),
])
def test_a_guide_that_expands_too_far_is_refused_naming_the_setting(guide_type, guide, product):
    """Refused before anything compiles, whatever the guide type; no single bound passes
    guided_max_repetition, only their product does."""
    params = G(guide_type, guide)
    size = measure(params)
    assert size.repetition <= GuideLimits().max_repetition
    assert size.expansion == product
    with pytest.raises(InvalidRequestError) as exc:
        check_guide(params, GuideLimits(max_expansion=999_999))
    message = str(exc.value)
    assert f"the {guide_type} guide expands to {size.expansion} repetitions" in message
    assert "the limit is 999999" in message and "guided_max_expansion" in message
    with pytest.raises(InvalidRequestError, match="guided_max_expansion"):
        check_guide(params, GuideLimits())  # the default refuses these too
    check_guide(params, GuideLimits(max_expansion=0, max_repetition=0))  # 0 turns it off


@pytest.mark.parametrize("guide_type, guide, expansion", [
    ("regex", r"(\d{1,3}\.){3}\d{1,3}", 9),
    ("regex", r"[{(]{5}\((x){2}", 5),  # braces in a class, an escaped paren: not groups
    ("regex", r"(?:a{10}|b{20}){30}", 600),
    ("ebnf_grammar", 'root ::= "(" [a-z]{3} ")" # {99} in a comment\nx ::= "{7}"', 3),
    ("json_schema", json.dumps({"type": "object", "properties": {
        "tags": {"type": "array", "minItems": 3, "items": {"type": "string", "minLength": 4}},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}), 12),
    ("json_schema", json.dumps({"$defs": {"L": {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/L"}}},
                                "$ref": "#/$defs/L"}), 2),  # recursion counts once
])
def test_real_guides_measure_small(guide_type, guide, expansion):
    assert measure(G(guide_type, guide)).expansion == expansion
    check_guide(G(guide_type, guide), GuideLimits())


def test_the_measure_is_linear_in_the_guide():
    """A grammar whose rules each use the next twice (2^8000 as text) is measured in one pass."""
    grammar = "".join(f'r{i} ::= r{i + 1}{{2}} "x"\n' for i in range(8000)) + 'r8000 ::= "y"\n'
    assert ebnf_expansion(grammar) == 1 << 62  # saturated, not 2^8000
    assert regex_expansion("(" * 50000 + "a{2}" + "){2}" * 50000) == 1 << 62


