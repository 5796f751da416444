"""Guides of every type, sane and hostile: the shipped samples (specguide/training/data/guided_samples
and jsonschemabench_dev), JSON schemas, regexes, EBNF grammars, structural tags and choices that
nest deep, repeat big, or do not parse; `guides` draws a (guide type, guide text) pair."""
from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from specguide.training.prompts import data_dir

from .primitives import deep_json, escaped_quotes, json_values, odd_json_numbers

def _samples() -> list[tuple[str, str]]:
    """(guide type, text) of the shipped guide samples and JSONSchemaBench's development schemas."""
    folder = data_dir() / "guided_samples"
    out = []
    for entry in json.loads((folder / "manifest.json").read_text()):
        text = (folder / entry["file"]).read_text()
        kind = entry["kind"].split()[0]
        if entry["file"].endswith(".regex"):
            out.append(("regex", text[:-1] if text.endswith("\n") else text))
        elif kind in ("ebnf", "lark"):
            out.append(("ebnf_grammar", text))
        else:
            out.append((kind, text))
    bench = data_dir() / "jsonschemabench_dev"
    for sub in sorted(p for p in bench.iterdir() if p.is_dir()):
        for f in sorted(sub.glob("*.json"))[:6]:  # six of each subset: compile times stay seconds
            out.append(("json_schema", f.read_text()))
    return out


SAMPLES = _samples()


def _schema_nest(depth: int, key: str = "properties") -> str:
    if key == "items":
        return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


def nested_min_items(depth: int, n: int) -> str:
    s: Any = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s, "minItems": n}
    return json.dumps(s)


BIG = [0, 1, 64, 1000, 4000, 65536, 65537, 10**6, 10**12, 2**63]
hostile_schemas = st.one_of(
    st.builds(_schema_nest, st.sampled_from([10, 63, 64, 65, 600]), st.sampled_from(["properties", "items"])),
    st.builds(nested_min_items, st.sampled_from([1, 2, 3, 6]), st.sampled_from([2, 10, 100, 4000])),
    st.builds(lambda k, n: json.dumps({"type": "string", k: n}), st.sampled_from(["minLength", "maxLength"]),
              st.sampled_from(BIG)),
    st.builds(lambda k, n: json.dumps({"type": "array", "items": {"type": "string"}, k: n}),
              st.sampled_from(["minItems", "maxItems"]), st.sampled_from(BIG)),
    st.builds(lambda n: json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(n)},
                                    "required": [f"k{i}" for i in range(n)]}), st.sampled_from([50, 300, 1001])),
    st.builds(lambda n: json.dumps({"enum": [f"v{i}" for i in range(n)]}), st.sampled_from([1, 100, 5000])),
    st.builds(lambda p: json.dumps({"type": "string", "pattern": p}),
              st.sampled_from(["(a+)+$", "a{65536}", "(a{100}){100}", "[", "\\p{L}+", "(?=a)a", "(a)\\1"])),
    st.builds(lambda n: json.dumps({"type": "integer", "minimum": n, "maximum": -n}), st.sampled_from([1, 10**30])),
    st.builds(lambda f: json.dumps({"type": "string", "format": f}), st.sampled_from(["email", "uri", "date-time", "x"])),
    st.sampled_from([
        '{"$ref": "#"}', '{"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}',
        '{"$ref": "http://example.com/x.json"}', '{"type": "nonsense"}', '{"type": ["string", "integer", "null"]}',
        '{"allOf": [{"type": "string"}, {"type": "integer"}]}', '{"not": {}}', 'false', 'true', '[]', '1', '"x"',
        '{"type": "object", "additionalProperties": {"$ref": "#"}}', '{"anyOf": []}', '{}', '{"const": null}',
        '{"type": "object", "required": ["a"], "properties": {}, "additionalProperties": false}',
        '{"type": "number", "multipleOf": 0}', '{"type": "number", "multipleOf": 1e-300}',
        '{"type": "array", "prefixItems": [{"type": "integer"}], "items": false, "minItems": 5}',
        '{"type": "object", "properties": {"a": {"type": "integer"}}', '{"type": "object",}',
    ]),
    st.builds(escaped_quotes, st.sampled_from([1, 100, 2000, 8000])),
    st.builds(lambda s: s, deep_json),
    st.builds(lambda n: '{"type": "string", "description": "' + "x" * n + '"}', st.sampled_from([100, 300_000])),
    odd_json_numbers.map(lambda n: '{"type": "integer", "maximum": ' + n + "}"),
)
hostile_regexes = st.one_of(
    st.builds(lambda a, b: f"(a{{{a}}}){{{b}}}", st.sampled_from([1, 10, 100, 4000]), st.sampled_from([1, 10, 100, 4000])),
    st.builds(lambda n: f"[0-9]{{{n}}}", st.sampled_from([0, 3, 65536, 65537, 10**9, 2**64])),
    st.builds(lambda n: f"a{{0,{n}}}", st.sampled_from([8, 65536, 10**7])),
    st.builds(lambda n: "(" * n + "a" + ")" * n, st.sampled_from([10, 64, 500, 5000])),
    st.builds(lambda n: "|".join(f"w{i}" for i in range(n)), st.sampled_from([2, 500, 20000])),
    st.sampled_from(["", "(", ")", "[", "a**", "a{2,1}", "\\", "(?P<n>a)(?P=n)", "(a)\\1", "(?<=a)b", "\\p{Greek}",
                     "[^\\x00-\\x{10FFFF}]", "a{,5}", ".*", "(.*)*", "[\\d\\D]{5}", "\\u{1F600}", "x" * 1000,
                     "(a|a)*b", "\\b", "^$", "[z-a]"]),
    st.text(max_size=16),
)
hostile_grammars = st.one_of(
    st.sampled_from(['root ::= "a"', 'root ::= root', 'root ::= foo', 'root ::= ', '', 'root ::= "a" |',
                     'root ::= [', 'root ::= "a"{5}', 'root ::= "a"{0,65536}', 'root ::= "a"{2,1}',
                     'root ::= ("a" ("b" ("c")*)*)*', 'root ::= "\\x00"', 'start: "a"', 'root ::= [^]',
                     'root ::= "a" root?', 'root ::= x\nx ::= y\ny ::= x', 'root ::= "' + "\\\"" * 1000 + '"',
                     'root ::= "unterminated']),
    st.builds(lambda n: "root ::= " + "(" * n + '"a"' + ")" * n, st.sampled_from([10, 100, 5000])),
    st.builds(lambda a, b: f'root ::= ("a"{{{a}}}){{{b}}}', st.sampled_from([1, 100, 4000]), st.sampled_from([1, 100, 4000])),
    st.builds(lambda n: "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "."',
              st.sampled_from([5, 2000])),
    st.text(max_size=24),
)


def _tag(structures: Any, triggers: Any) -> str:
    return json.dumps({"type": "structural_tag", "structures": structures, "triggers": triggers})


hostile_tags = st.one_of(
    st.sampled_from(['{}', '[]', '"x"', '{"type": "structural_tag"}', '{"type": "structural_tag", "format": {}}',
                     '{"type": "structural_tag", "format": {"type": "nonsense"}}', '{"structures": [], "triggers": []}',
                     '{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [], "tags": []}}',
                     '{"type": "structural_tag", "format": {"type": "regex", "pattern": "(a{4000}){4000}"}}']),
    st.builds(_tag, st.lists(st.fixed_dictionaries({"begin": st.text(max_size=8), "schema": st.one_of(
        st.just({"type": "object"}), json_values), "end": st.text(max_size=8)}), max_size=3),
        st.lists(st.text(max_size=6), max_size=3)),
    st.builds(lambda n: _tag([{"begin": f"<f{i}>", "schema": {"type": "object"}, "end": "</f>"} for i in range(n)],
                             ["<f"]), st.sampled_from([1, 500, 5000])),
    st.builds(lambda s: s, deep_json),
)
hostile_choices = st.one_of(
    st.builds(json.dumps, st.lists(st.text(max_size=10), max_size=6)),
    st.builds(lambda v: json.dumps(v, allow_nan=True), json_values),
    st.builds(lambda n: json.dumps([f"c{i}" for i in range(n)]), st.sampled_from([0, 1, 1000, 100_000])),
    st.builds(lambda n: json.dumps(["x" * n, "y"]), st.sampled_from([1000, 200_000])),
    st.sampled_from(['[""]', '["a", "a"]', '[1, 2]', '[null]', '[[]]', '["a"', 'a,b', '{}', '[' * 100 + ']' * 100]),
)


def guides(hostile: bool = True) -> st.SearchStrategy[tuple[str, str]]:
    """(guide type, guide text): a shipped sample, a small sane guide, or (hostile) a bad one of any type."""
    sane = st.one_of(st.sampled_from(SAMPLES), st.sampled_from([
        ("json", ""), ("regex", "[0-9]{3}-[0-9]{4}"), ("choice", '["yes", "no"]'), ("json_schema", '{"type": "integer"}'),
        ("ebnf_grammar", 'root ::= "yes" | "no"'), ("regex", "(cat|dog)s?"), ("choice", '["oui", "peut-\u00eatre"]'),
        ("regex", "(\u00e9t\u00e9|hiver)"), ("json_schema", '{"enum": ["\u00e9t\u00e9", "\u4e2d\u6587"]}')]))
    if not hostile:
        return sane
    bad = st.one_of(
        st.tuples(st.just("json_schema"), hostile_schemas),
        st.tuples(st.just("regex"), hostile_regexes),
        st.tuples(st.just("ebnf_grammar"), hostile_grammars),
        st.tuples(st.just("structural_tag"), hostile_tags),
        st.tuples(st.just("choice"), hostile_choices),
        st.tuples(st.just("json"), st.sampled_from(["", " ", "{}", "x"])),
        st.tuples(st.sampled_from(["", "JSON", "Regex ", "lark", "grammar", "json_object", "\x00", "x" * 1000]),
                  st.sampled_from(["", "a", "{}"])),
    )
    return st.one_of(sane, bad)
