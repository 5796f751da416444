"""Client regexes run in linear time (issue 75): JSON Schema `pattern` / `patternProperties` in the
budget's scanner, the value check's paths and its jsonschema validator go through
guided/client_regex.py (RE2; lookaround: a bounded automaton of our own); what no linear-time
engine runs is refused at intake. The pathological cases take Python's backtracking `re` hours
(2^40 steps): `timeout` guards them, no wall-clock assertion."""
from __future__ import annotations

import json
import re

import pytest

from specguide.guided import client_regex
from specguide.guided.json_scanner import Scanner
from specguide.guided.params import looks_like_lark
from specguide.guided.partial_scalar import escape_end
from specguide.guided.schema import json_schema_of
from specguide.guided.schema_completion import Schemas
from specguide.guided.value_check import ValueChecker, make_validator
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

EVIL_KEY = "a" * 40 + "b"
NESTED = {"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}},
          "additionalProperties": {"type": "string"}}


def errors(schema, value):
    return [e.message for e in make_validator(schema).iter_errors(value)]


@pytest.mark.timeout(60)
def test_the_budget_scanner_reads_a_key_against_a_redos_pattern():
    sc = Scanner(Schemas(NESTED))
    st = sc.feed(sc.start(), ('{"' + EVIL_KEY + '":').encode())
    assert sc.child(st.stack[-1]) == {"type": "string"}  # not the pattern's: additionalProperties
    st = sc.feed(sc.start(), ('{"' + "a" * 40 + '":').encode())
    assert sc.child(st.stack[-1]) == {"type": "integer"}


@pytest.mark.timeout(60)
def test_the_value_check_finds_a_keys_subschemas_against_a_redos_pattern():
    assert ValueChecker._children(NESTED, EVIL_KEY) == [{"type": "string"}]
    assert ValueChecker._children(NESTED, "a" * 40) == [{"type": "integer"}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("draft", [None, "https://json-schema.org/draft/2019-09/schema",
                                   "https://json-schema.org/draft/2020-12/schema"])
def test_jsonschema_keywords_run_pathological_patterns_in_linear_time(draft):
    tag = {"$schema": draft} if draft else {}
    for patrn in ("^(a+)+$", "^(a|a)*$", "^(a|aa)+$", "^(a*)*$"):
        assert errors({**tag, "type": "string", "pattern": patrn}, EVIL_KEY) == [f"{EVIL_KEY!r} does not match {patrn!r}"]
        assert errors({**tag, "type": "string", "pattern": patrn}, "a" * 40) == []
    assert errors({**tag, **NESTED}, {EVIL_KEY: "x", "a" * 40: 1}) == []
    assert errors({**tag, **NESTED}, {"a" * 40: "x"}) == ["'x' is not of type 'integer'"]
    closed = {**tag, "type": "object", "patternProperties": {"^(a+)+$": {}}, "additionalProperties": False}
    assert errors(closed, {"a" * 40: 1}) == []
    assert errors(closed, {EVIL_KEY: 1}) == [f"{EVIL_KEY!r} does not match any of the regexes: '^(a+)+$'"]
    names = {**tag, "type": "object", "propertyNames": {"pattern": "^(a+)+$"}}
    assert errors(names, {"a" * 40: 1}) == [] and len(errors(names, {EVIL_KEY: 1})) == 1
    if draft:  # unevaluatedProperties looks through patternProperties too
        unev = {**tag, "type": "object", "patternProperties": {"^(a+)+$": {}}, "unevaluatedProperties": False}
        assert errors(unev, {"a" * 40: 1}) == []
        assert errors(unev, {EVIL_KEY: 1}) == [f"Unevaluated properties are not allowed ({EVIL_KEY!r} was unexpected)"]


@pytest.mark.timeout(120)
def test_a_generated_key_against_a_redos_pattern_property_is_checked_promptly(xgr_service, hf_tokenizer):
    """End to end on llguidance: `uniqueItems` makes it compile lenient, so patternProperties is
    value-checked as each token closes a key or value, then on the stop token."""
    from specguide.guided.check import check_case

    schema = {**NESTED, "properties": {"l": {"type": "array", "uniqueItems": True}}}
    tests = [({EVIL_KEY: "x"}, True), ({"a" * 40: 1}, True), ({"a" * 40: "x"}, False), ({EVIL_KEY: 1}, False)]
    r = check_case(xgr_service, lambda t: hf_tokenizer.encode(t, add_special_tokens=False),
                   {"schema": schema, "tests": [{"data": d, "valid": v} for d, v in tests]}, "t", "llguidance")
    assert r.compiled, r.error
    assert {i: w["accepted"] for i, t in enumerate(r.tests) for w in t.values()} == {i: v for i, (_, v) in enumerate(tests)}


# ordinary patterns: the answers Python's re gave (texts with no trailing newline, ASCII digits)
ORDINARY = [r"^[a-z]+$", r"\d{3}", r"^\d{3}-\d{4}$", r"^[A-Z][a-z]*(?: [A-Z][a-z]*)*$", r"^\w+@\w+\.com$",
            r"(?i)^hello$", r"^(Hello|Hi|Hey)$", r"^\u00e9t\u00e9$", r"[\u0041-\u005A]{2}", r"^\s*$", r"\bcat\b",
            r"^#[0-9a-fA-F]{6}$", r"^$", r"colou?r", r"^[^@\s]+@[^@\s]+$", r"^.{2,4}$", r"\.", r"^(?P<y>\d{4})-\d\d$",
            r"a{2,}", r"^\S+$", r"é+"]
TEXTS = ["abc", "ABC", "Abc Def", "123", "555-1234", "a@b.com", "hello", "HeLLo", "Hi", "été", "ete", "AB", "x",
         "", " \t ", "the cat sat", "concat", "#a0B1c2", "color", "colour", "a b@c", "a.b", "2024-01", "aaa", "ééé"]


@pytest.mark.parametrize("patrn", ORDINARY)
def test_ordinary_patterns_answer_as_before(patrn):
    assert client_regex.compile(patrn).engine == "re2"
    for text in TEXTS:
        assert client_regex.search(patrn, text) == (re.search(patrn, text) is not None), (patrn, text)


def test_ecma_syntax_and_classes():
    """What JSON Schema's (ECMA-262) regexes have and Python's re or RE2 lack."""
    cases = [(r"^\p{L}+$", "héllo", True), (r"^\p{L}+$", "h1", False), (r"^\p{Lu}", "Été", True),
             (r"^\p{Script=Greek}+$", "αβ", True), (r"^\p{sc=Greek}+$", "ab", False),
             (r"^\u{1F600}$", "\U0001F600", True), (r"^\uD83D\uDE00$", "\U0001F600", True), (r"^\cJ$", "\n", True),
             (r"^[\b]$", "\b", True), (r"^\s$", "\u00a0", True), (r"^\s$", "\u2003", True), (r"^\S$", "\u3000", False),
             (r"^\d$", "\u0663", False),  # ECMA's \d and \w are ASCII, as llguidance reads them (Python's re:
             (r"^[\w.-]+$", "été", False), (r"^\w+$", "_a1", True),  # Unicode; \s is Unicode in all three)
             (r"^a$", "a\n", False),  # ECMA's $ is the end (Python's re also matches before a final newline)
             (r"a\Z", "ba", True), (r"^[a[]+$", "a[", True), (r"^[]a]+$", "]a", True), (r"\/", "a/b", True)]
    for patrn, text, want in cases:
        assert client_regex.search(patrn, text) is want, (patrn, text)


@pytest.mark.parametrize("patrn, feature", [
    (r"^(a)\1$", "a backreference"), (r"(?P<x>a)(?P=x)", "a backreference"), (r"(?<x>a)\k<x>", "a backreference"),
    (r"(?>a+)b", "an atomic group"), (r"(a)?(?(1)b|c)", "a conditional group"), (r"(?=a)a*+", "a possessive quantifier"),
    (r"a*+", "bad repetition operator"), (r"[a-", "missing ]"), (r"x{1001}", "invalid repetition size")])
def test_unsupported_patterns_are_refused_at_intake_naming_the_feature(patrn, feature):
    with pytest.raises(client_regex.UnsupportedPattern, match=re.escape(feature)):
        client_regex.compile(patrn)
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": patrn}}}
    with pytest.raises(InvalidRequestError, match=r"invalid json_schema guide: pattern .*" + re.escape(feature)
                       + r".*\(at /properties/p/pattern\); patterns run in RE2"):
        json_schema_of(G("json_schema", json.dumps(schema)))
    keyed = {"type": "object", "patternProperties": {patrn: {}}}
    with pytest.raises(InvalidRequestError, match=r"\(at /patternProperties\)"):
        json_schema_of(G("json_schema", json.dumps(keyed)))
    assert errors({"type": "string", "format": "regex"}, patrn) == [f"{patrn!r} is not a 'regex'"]


def test_a_backreference_is_refused_by_both_backends(service):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": r"^(a)\1$"}}}
    with pytest.raises(InvalidRequestError, match=r"backreference .*\(at /properties/p/pattern\)"):
        service.submit(G("json_schema", json.dumps(schema))).result(timeout=120)


LOOKAROUND = [r"^(?!@@)[a-z@]+$", r"(?<=a)b", r"(?<!a)b", r"^(?=.*[A-Z])(?=.*\d).{8,}$", r"x(?!y)", r"^(?:a(?=b)|c)+",
              r"(?i)^(?!abc)[a-z]+$", r"^(?=(a+)+$)"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("patrn", LOOKAROUND)
def test_lookaround_runs_in_a_bounded_automaton_with_re_s_answers(patrn):
    c = client_regex.compile(patrn)
    assert c.engine == "lookaround"
    for text in TEXTS + ["@@ab", "a@b", "ab", "ba", "cb", "b", "Passw0rdX", "passw0rd", "xy", "xz", "acab"]:
        assert c.search(text) == (re.search(patrn, text) is not None), (patrn, text)
    slow = patrn == r"^(?=(a+)+$)"  # re takes hours on this one
    assert c.search(EVIL_KEY) == (False if slow else re.search(patrn, EVIL_KEY) is not None)


@pytest.mark.timeout(60)
def test_lookaround_past_its_work_bound_is_not_accepted():
    patrn = r"^(?!x)(a+)+$"
    assert client_regex.search(patrn, "a" * 100) and not client_regex.search(patrn, "a" * 100 + "b")
    with pytest.raises(client_regex.TextTooCostly):
        client_regex.search(patrn, "a" * client_regex.MAX_WORK)
    (msg,) = errors({"type": "string", "pattern": patrn}, "a" * client_regex.MAX_WORK)
    assert "cannot be checked against" in msg
    assert ValueChecker._children({"patternProperties": {patrn: {"type": "integer"}}}, "a" * client_regex.MAX_WORK) == [None]


@pytest.mark.timeout(60)
def test_fixed_patterns_on_client_text_stay_linear():
    """Our own regexes applied to client text stay linear in it: a half-written `\\u` escape at a
    string's end (a search that rescans each run of backslashes would be quadratic) and the Lark
    `start:` sniff of a grammar guide (`^\\s*` rescanning every blank line after each would be
    quadratic in a 256 KB guide)."""
    assert escape_end(b"\\" * 200_000 + b"x") == ""
    assert escape_end(b"ab\\u1") == "000" and escape_end(b"\\\\u1") == "" and escape_end(b"\\\\\\u") == "0000"
    assert looks_like_lark("\n" * 262_144 + "x") is False
    assert looks_like_lark("\n\n  ?start: a") and looks_like_lark("x\n start :") and not looks_like_lark("a ::= b\nstart: c")
