"""Hypothesis strategies for hostile requests (issue 75's fuzzing suite): what a client can send.

Each strategy draws a `Case`: one request to one target, cheap to serve unless the point is the size
of an input (every valid `max_tokens` is <= 8; a drawn length past that is one the server must
refuse, e.g. 2049 > max_seq_len). Targets:

- `specguide` (gRPC stream), `specguide_unary` (gRPC infer), `specguide_vllm` (gRPC stream): raw
  tensors. Names: the declared inputs of each interface (`specguide.triton.interfaces`, the one
  declaration the config.pbtxt files are generated from) and unknown ones; dtypes: the declared one
  mostly, a wrong one sometimes; shapes: [B, 1] with B in 1..3 or 64 / 65, and [1, 0], [0, 1],
  missing or extra dimensions; values: extremes (negative, huge, NaN / inf, int overflow, past the
  vocabulary), empty strings, invalid UTF-8, long strings up to and past the caps.
- `http` (Triton's HTTP `generate` / `generate_stream` of the three names): JSON bodies with the
  right keys and wrong JSON types, unknown keys, raw text that is not JSON.
- `openai_completions`, `openai_chat` (the OpenAI server): bodies with every field, odd values and
  wrong types (n, many prompts, stop lists, tools, logit_bias, response_format, guides, streams).

`sampling_parameters` JSON and guides of every type (json, json_schema, regex, ebnf_grammar,
structural_tag, choice) are drawn sane (the shipped samples: specguide/training/data/guided_samples
and jsonschemabench_dev) and hostile (deep nesting, big repetition bounds, escaped-quote runs,
invalid syntax), and go into all targets.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from hypothesis import strategies as st

from specguide.triton.interfaces import INTERFACES, Spec
from specguide.training.prompts import data_dir

def _pin_constants() -> None:
    """Draws that depend on the seed alone. Hypothesis mixes into its draws constants it reads from
    the project's modules loaded at the time (hypothesis.internal.conjecture.providers
    `_get_local_constants`): a run of one test file and `make test` load different modules, and every
    commit changes them, so the same seed drew different cases. Hypothesis is pinned
    (requirements-test.txt); without that function this does nothing."""
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    if hasattr(providers, "_get_local_constants"):
        none = Constants()
        providers._get_local_constants = lambda: none


_pin_constants()

VOCAB = 49152  # the default model's vocabulary (SmolLM2-135M-Instruct); ids at or past it are out of it
EOS = 2
PROMPT_BYTES_CAP = 32768  # max_prompt_bytes default (16 x max_seq_len)
GUIDE_BYTES_CAP = 262144  # guided_max_guide_bytes
JSON_BYTES_CAP = 327680  # max_sampling_parameters_bytes default
MAX_SEQ_LEN = 2048

ENGINE, UNARY, VLLM = "specguide", "specguide_unary", "specguide_vllm"
TARGETS = (ENGINE, UNARY, VLLM, "http", "openai_completions", "openai_chat")
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")


@dataclass
class Case:
    """One hostile request. `target` is one of TARGETS; Triton targets carry `tensors` (name -> array,
    the array's dtype is the Triton type sent), HTTP / OpenAI ones `path` and a raw `body`."""

    target: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    path: str = ""
    body: bytes = b""
    request_id: str = ""
    stream: bool = False  # an OpenAI body's "stream" (read as SSE); HTTP: generate_stream

    def describe(self, limit: int = 600) -> str:
        """A short, printable description (long values cut) for reports."""
        if self.tensors:
            parts = []
            for name, arr in self.tensors.items():
                flat = np.asarray(arr).reshape(-1)
                head = [_short(v) for v in flat[:4]]
                more = f"+{flat.size - 4}" if flat.size > 4 else ""
                parts.append(f"{name}:{arr.dtype}{list(arr.shape)}={head}{more}")
            text = f"{self.target} id={_short(self.request_id, 24)} " + " ".join(parts)
        else:
            text = f"{self.target} {self.path} stream={self.stream} body={_short(self.body, limit)}"
        return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit})"


def _short(v: Any, n: int = 60) -> str:
    if isinstance(v, (bytes, bytearray)):
        r = repr(bytes(v[:n]))
        return r + (f"...({len(v)} bytes)" if len(v) > n else "")
    r = repr(v)
    return r if len(r) <= n else r[:n] + f"...({len(r)} chars)"


# ------------------------------------------------------------------------------ scalars

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT_EXTREMES = [0, 1, -1, 2, 7, 8, 9, 255, 256, 1000, 2047, 2048, 2049, 4096, VOCAB - 1, VOCAB, VOCAB + 1, 65535,
                65536, 999999, 10**9, INT32_MAX, INT32_MIN, INT32_MIN + 1, -2, -100, -VOCAB]
FLOAT_EXTREMES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-5, 9.99e-6, 1e-2, 2.0, 2.0001, -2.0001, 100.0, 100.1, 0.01, 0.0099,
                  1e-38, 1e-45, 1e30, -1e30, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]

ints32 = st.one_of(st.sampled_from(INT_EXTREMES), st.integers(INT32_MIN, INT32_MAX))
floats32 = st.one_of(st.sampled_from(FLOAT_EXTREMES), st.floats(width=32))
uint64s = st.one_of(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
# a length a client asks for: small (cheap to serve), or one the server must refuse
lengths = st.one_of(st.integers(0, 8), st.sampled_from([-1, -2, INT32_MIN, INT32_MAX, 2049, 4096, 10**6]))
small_counts = st.one_of(st.integers(0, 4), st.sampled_from([-1, 16, 17, 64, 65, 1000, INT32_MAX, INT32_MIN]))
# tokens the model writes often (" the", ".", ",", " a", "\n", " and", " of", " is", " The", "-", ...): a word
# list's prefix that matches what a sequence just wrote makes the engine look at the word's next id
COMMON_IDS = [260, 30, 28, 253, 198, 284, 282, 314, 378, 504, 288, 281, 1116, 29, 339, 57]
OUT_OF_VOCAB = [-1, -2, VOCAB, VOCAB + 1, 999999, INT32_MAX, INT32_MIN]
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(COMMON_IDS), st.sampled_from(OUT_OF_VOCAB + [EOS, 0]))

SPECIAL_TEXT = [b"", b" ", b"Hi", b"The capital of France is", b"\x00", b"\x00" * 64, b"\xff\xfe\xfd", b"\xc3",
                b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", "\u20ac\U0001f600".encode(), b"<|im_start|>",
                b"<|im_end|>", b"<|endoftext|>", b"\r\n\t", b"%s%n{0}", b"\\u0000", b"null", b"[]", b"{}",
                b"\xef\xbb\xbfBOM"]


def long_text(cap: int) -> st.SearchStrategy[bytes]:
    """A long string near and past `cap` bytes (ASCII, multibyte, invalid UTF-8)."""
    sizes = st.sampled_from([1000, 4000, cap - 1, cap, cap + 1, 2 * cap])
    fill = st.sampled_from([b"x", b"ab ", "\u00e9".encode(), b"\xff", b"word "])
    return st.builds(lambda n, f: (f * (n // len(f) + 1))[:n], sizes, fill)


def texts(cap: int = 64, long: bool = True) -> st.SearchStrategy[bytes]:
    """Bytes of a string input: special values, random text, random bytes; long ones rarely."""
    options = [st.sampled_from(SPECIAL_TEXT), st.text(max_size=24).map(lambda s: s.encode("utf-8", "surrogatepass")),
               st.binary(max_size=24)]
    if long:
        options.append(long_text(cap))
    return st.one_of(*options)


# ------------------------------------------------------------------------------ JSON values

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(INT_EXTREMES),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["", "16", "-1", "1e9", "nan", "inf", "0x10", " 8 ", "true", "\u0000", "\ud800"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def cheap(v: Any) -> Any:
    """A drawn length made cheap to serve: one the server would honour past 8 tokens becomes 8 (a
    refused one stays as drawn)."""
    try:
        n = float(v.strip()) if isinstance(v, str) else v
        if not isinstance(n, bool) and isinstance(n, (int, float)) and 8 < n <= MAX_SEQ_LEN:
            return "8" if isinstance(v, str) else 8
    except (ValueError, OverflowError):
        pass
    return v


def nested(depth: int, kind: str = "list") -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


deep_json = st.builds(nested, st.sampled_from([8, 70, 73, 200, 5000, 100_000]), st.sampled_from(["list", "object"]))
# numbers Python's json reads as huge ints, inf, or nan
odd_json_numbers = st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 400, "-" + "9" * 5000,
                                    "1" + "0" * 4300, "1.5e-400", "0.1e1", "-0"])


def escaped_quotes(n: int) -> str:
    """An unterminated JSON string of escaped quotes (issue 75: the depth scan went quadratic on it)."""
    return '"' + '\\"' * n


# ------------------------------------------------------------------------------ guides

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


def _nested_min_items(depth: int, n: int) -> str:
    s: Any = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s, "minItems": n}
    return json.dumps(s)


BIG = [0, 1, 64, 1000, 4000, 65536, 65537, 10**6, 10**12, 2**63]
hostile_schemas = st.one_of(
    st.builds(_schema_nest, st.sampled_from([10, 63, 64, 65, 600]), st.sampled_from(["properties", "items"])),
    st.builds(_nested_min_items, st.sampled_from([1, 2, 3, 6]), st.sampled_from([2, 10, 100, 4000])),
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


# ------------------------------------------------------------------------------ sampling_parameters

VLLM_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "bad_words", "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "logprobs", "prompt_logprobs", "n", "best_of", "use_beam_search", "length_penalty",
             "include_stop_str_in_output", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
             "output_kind", "truncate_prompt_tokens", "lora_name", "max_completion_tokens", "early_stopping",
             "extra_args", "guided_decoding", "structured_outputs")
UNKNOWN_KEYS = ("", "foo", "MAX_TOKENS", "max_tokens ", "__proto__", "constructor", "\x00", "x" * 300, "top-k")
GUIDE_KEY = {"json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar", "structural_tag": "structural_tag",
             "choice": "choice", "json": "json_object"}


@st.composite
def structured_outputs(draw, hostile: bool = True) -> Any:
    """vLLM's `structured_outputs` / `guided_decoding` value: a guide under its key, options, odd shapes."""
    gtype, text = draw(guides(hostile))
    key = GUIDE_KEY.get(gtype, gtype or "x")
    value: Any = text
    if gtype == "choice":
        try:
            value = json.loads(text)
        except ValueError:
            value = text
    elif gtype == "json":
        value = draw(st.sampled_from([True, False, 1, "yes", None]))
    elif gtype == "json_schema" and draw(st.booleans()):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = text
    out: dict[str, Any] = {key: value}
    if not hostile:
        return out
    for opt in draw(st.lists(st.sampled_from(["backend", "disable_any_whitespace", "whitespace_pattern", "strict",
                                              "best_effort", "any_key_order", "undeclared_keys",
                                              "complete_within_budget", "disable_additional_properties", "foo",
                                              "regex", "choice"]), max_size=3, unique=True)):
        out[opt] = draw(st.one_of(st.sampled_from(["xgrammar", "llguidance", "guidance", "outlines", "allow", "forbid",
                                                   "", " ", "\\s*", "(\\s)*" * 20]), json_scalars))
    return draw(st.one_of(st.just(out), st.just(out), json_values, st.just(json.dumps(out, allow_nan=True))))


SANE_WORDS = st.lists(st.sampled_from(["\n", ".", "the", " Paris", "!", ",", "sea", "\u00e9t\u00e9"]), max_size=3)
SANE_IDS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4)


def vllm_sane(key: str) -> st.SearchStrategy[Any]:
    """A value the vLLM backend accepts for `key` (cheap: at most 8 tokens)."""
    floats = {"temperature": (0.0, 2.0), "top_p": (0.01, 1.0), "min_p": (0.0, 1.0), "repetition_penalty": (0.5, 2.0),
              "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "length_penalty": (0.0, 2.0)}
    if key in floats:
        lo, hi = floats[key]
        return st.floats(lo, hi)
    sane: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.integers(1, 8), "max_completion_tokens": st.integers(1, 8), "min_tokens": st.integers(0, 4),
        "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**32), "logprobs": st.integers(0, 5),
        "prompt_logprobs": st.integers(0, 3), "n": st.just(1), "best_of": st.just(1), "use_beam_search": st.just(False),
        "stop": st.one_of(SANE_WORDS, st.sampled_from([".", "\n"])), "stop_token_ids": SANE_IDS,
        "bad_words": SANE_WORDS, "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=4),
        "detokenize": st.just(True), "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
        "structured_outputs": structured_outputs(hostile=False), "guided_decoding": structured_outputs(hostile=False),
    }
    return sane.get(key, json_scalars)


def vllm_value(key: str) -> st.SearchStrategy[Any]:
    """A value for `key`: sane (two thirds) or hostile."""
    return st.one_of(vllm_sane(key), vllm_sane(key), vllm_hostile(key))


def vllm_hostile(key: str) -> st.SearchStrategy[Any]:
    odd = json_values
    if key in ("max_tokens", "max_completion_tokens"):
        return st.one_of(lengths, lengths.map(str), odd.map(cheap))
    if key in ("min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "n", "best_of", "truncate_prompt_tokens"):
        return st.one_of(ints32, st.integers(-(2**70), 2**70), odd)
    if key in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "length_penalty"):
        return st.one_of(st.sampled_from([f for f in FLOAT_EXTREMES if math.isfinite(f)]), st.floats(allow_nan=False,
                                                                                                     allow_infinity=False), odd)
    if key == "stop":
        return st.one_of(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=6),
                         st.builds(lambda n: ["s"] * n, st.sampled_from([100, 10_000])),
                         st.builds(lambda n, k: [f"{i}" * k for i in range(n)], st.sampled_from([10, 2000]),
                                   st.sampled_from([1, 40])), odd)
    if key == "stop_token_ids":
        return st.one_of(st.lists(token_ids, max_size=6), st.builds(lambda n: list(range(n)), st.sampled_from([1000, 50_000])),
                         odd)
    if key == "bad_words":
        return st.one_of(st.lists(st.text(max_size=8), max_size=6), st.text(max_size=8),
                         st.builds(lambda n: [f"w{i}" for i in range(n)], st.sampled_from([100, 10_000])), odd)
    if key == "logit_bias":
        return st.one_of(st.dictionaries(st.one_of(token_ids.map(str), st.text(max_size=6)), st.one_of(floats32.filter(
            math.isfinite), json_scalars), max_size=6),
            st.builds(lambda n: {str(i): 1.0 for i in range(n)}, st.sampled_from([300, 301, 49152])), odd)
    if key in ("structured_outputs", "guided_decoding"):
        return structured_outputs()
    return odd


@st.composite
def sampling_parameters(draw) -> bytes:
    """A `sampling_parameters` JSON string: vLLM keys with odd values, unknown keys, deep nesting, huge
    numbers, wrong types, text that is not JSON. A valid max_tokens (<= 8) is added unless drawn."""
    kind = draw(st.sampled_from(["keys"] * 8 + ["value", "deep", "number", "raw", "quotes", "big"]))
    if kind == "value":
        return json.dumps(draw(json_values), allow_nan=True).encode()
    if kind == "deep":
        d = draw(st.sampled_from([70, 73, 5000, 100_000]))
        return ('{"max_tokens": 4, "stop": ' + nested(d) + "}").encode()
    if kind == "number":
        return ('{"max_tokens": 4, "' + draw(st.sampled_from(["temperature", "seed", "top_k", "max_tokens"])) + '": '
                + draw(odd_json_numbers) + "}").encode()
    if kind == "raw":
        return draw(st.one_of(texts(64, long=False), st.sampled_from([b"{", b"{'max_tokens': 4}", b"null",
                                                                       b'{"max_tokens": 4,}', b"\xff{}"])))
    if kind == "quotes":
        return ('{"max_tokens": 4, "stop": ' + escaped_quotes(draw(st.sampled_from([10, 4000, 24000]))) + "}").encode()
    if kind == "big":
        n = draw(st.sampled_from([JSON_BYTES_CAP - 40, JSON_BYTES_CAP + 1]))
        return ('{"max_tokens": 4, "stop": ["' + "x" * n + '"]}').encode()
    keys = draw(st.lists(st.one_of(st.sampled_from(VLLM_KEYS), st.sampled_from(UNKNOWN_KEYS)), max_size=5, unique=True))
    d: dict[str, Any] = {}
    for k in keys:
        d[k] = draw(vllm_value(k))
    if "max_tokens" not in d and "max_completion_tokens" not in d and draw(st.integers(0, 9)):
        d["max_tokens"] = draw(st.integers(1, 8))
    return json.dumps(d, allow_nan=True).encode()


# ------------------------------------------------------------------------------ Triton tensors

NP = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64,
      "TYPE_BOOL": np.bool_}
WRONG_DTYPES = [np.object_, np.int32, np.int64, np.float32, np.float64, np.float16, np.bool_, np.uint64, np.int8,
                np.uint8, np.uint32, np.int16]
UNKNOWN_NAMES = ["foo", "TEXT_INPUT", "text_input ", "prompt", "lora_weights", "prompt_embedding_table",
                 "draft_input_ids", "x" * 200, "max_tokens\x00", "image", "embedding_request", "return_finish_reason",
                 "input_ids", "sampling_parameters", "text_output", "specguide_error"]
# names whose values mean something (drawn with care); the rest by their declared dtype
LENGTH_NAMES = {"max_tokens", "request_output_len"}


def _array(values: list, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """`values` cycled into an array of `shape` and `dtype` (wrapped, as C would, when out of range)."""
    n = int(np.prod(shape)) if shape else 1
    vals = (values * (n // max(len(values), 1) + 1))[:n] if values else []
    if dtype is np.object_:
        conv = [v if isinstance(v, bytes) else str(v).encode() for v in vals]
        return np.array(conv + [b""] * (n - len(conv)), dtype=np.object_).reshape(shape)
    with np.errstate(all="ignore"):
        out = []
        for v in vals:
            if isinstance(v, bytes):
                v = len(v)
            if np.issubdtype(dtype, np.integer) and isinstance(v, float):
                v = 0 if not math.isfinite(v) else int(max(min(v, 2**63 - 1), -(2**63)))
            if np.issubdtype(dtype, np.integer):
                info = np.iinfo(dtype)
                v = (int(v) - info.min) % (info.max - info.min + 1) + info.min  # wrap
            out.append(v)
        arr = np.array(out + [0] * (n - len(out)), dtype=np.float64 if np.issubdtype(dtype, np.floating) else object)
        return arr.astype(dtype).reshape(shape)


SANE_PROMPTS = [b"The capital of France is", b"Hi", b"Write a haiku about the sea.", b"1, 2, 3,",
                "\u00bfD\u00f3nde est\u00e1 la playa?".encode(), b"<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"]


def _word_list(words: list[list[int]]) -> list:
    ids = [i for w in words for i in w]
    offsets, end = [], 0
    for w in words:
        end += len(w)
        offsets.append(end)
    width = max(len(ids), 1)
    return [(ids + [0] * width)[:width], (offsets + [-1] * width)[:width]]


@st.composite
def sane_row(draw, name: str, spec: Spec) -> list:
    """One row's values for input `name` that the server accepts (cheap: at most 8 tokens)."""
    if name in LENGTH_NAMES:
        return [draw(st.integers(1, 8))]
    if name in ("min_tokens", "min_length"):
        return [draw(st.integers(0, 4))]
    if name == "text_input":
        return [draw(st.sampled_from(SANE_PROMPTS))]
    if name == "input_ids":
        return draw(SANE_IDS)
    if name == "input_lengths":
        return [1]
    if name == "num_return_sequences":
        return [draw(st.integers(1, 3))]
    if name == "num_draft_tokens":
        return [draw(st.integers(0, 4))]
    if name == "beam_width":
        return [1]
    if name in ("end_id", "pad_id"):
        return [draw(st.integers(0, VOCAB - 1))]
    if name in ("stop_words_list", "bad_words_list"):
        return _word_list(draw(st.lists(SANE_IDS, min_size=1, max_size=3)))
    if name == "embedding_bias":
        i, w = draw(st.integers(0, VOCAB - 1)), draw(st.floats(-100, 100, width=32))
        return [w if j == i else 0.0 for j in range(VOCAB)]
    if name in ("stop_words", "bad_words", "embedding_bias_words"):
        return [w.encode() for w in draw(SANE_WORDS)] or [b"."]
    if name == "embedding_bias_weights":
        return [draw(st.floats(-100, 100, width=32))]
    if name == "guided_decoding_guide_type":
        return [draw(st.sampled_from(GUIDE_TYPES)).encode()]
    if name == "guided_decoding_guide":
        return [draw(guides(hostile=False))[1].encode()]
    if name == "sampling_parameters":
        keys = draw(st.lists(st.sampled_from(VLLM_KEYS), max_size=4, unique=True))
        d = {k: draw(vllm_sane(k)) for k in keys}
        d.setdefault("max_tokens", draw(st.integers(1, 8)))
        return [json.dumps(d).encode()]
    if name in ("temperature", "top_p", "runtime_top_p"):
        return [draw(st.floats(0.0, 1.5, width=32))]
    if name in ("frequency_penalty", "presence_penalty"):
        return [draw(st.floats(-2.0, 2.0, width=32))]
    if name == "repetition_penalty":
        return [draw(st.floats(0.5, 2.0, width=32))]
    if name in ("top_k", "runtime_top_k"):
        return [draw(st.integers(0, 50))]
    if name == "timeout_s":
        return [draw(st.floats(0.0, 60.0, width=32))]
    if name == "stop":
        return [False]
    return draw(row_values(name, spec))


@st.composite
def row_values(draw, name: str, spec: Spec) -> list:
    """One row's values for input `name` in its declared dtype (a list: [1] dims give one value),
    hostile: extremes, odd lengths, bad guides and JSON."""
    dt = spec.dtype
    if name in LENGTH_NAMES:
        return [draw(lengths)]
    if name in ("min_tokens", "min_length"):
        return [draw(st.one_of(st.integers(0, 8), ints32))]
    if name == "text_input":
        return [draw(texts(PROMPT_BYTES_CAP))]
    if name == "input_ids":
        n = draw(st.one_of(st.integers(0, 8), st.sampled_from([MAX_SEQ_LEN - 1, MAX_SEQ_LEN, 5000])))
        if n > 8:
            return [draw(token_ids)] * n
        return draw(st.lists(token_ids, min_size=n, max_size=n))
    if name in ("input_lengths", "num_return_sequences", "num_draft_tokens", "beam_width"):
        return [draw(small_counts)]
    if name in ("end_id", "pad_id"):
        return [draw(token_ids)]
    if name in ("stop_words_list", "bad_words_list"):
        if draw(st.integers(0, 3)) == 0:  # a common token, then one out of the vocabulary (issue 75)
            return _word_list([[draw(st.sampled_from(COMMON_IDS)), draw(st.sampled_from(OUT_OF_VOCAB))]])
        ids = draw(st.lists(token_ids, min_size=0, max_size=6))
        offsets = draw(st.one_of(st.just(list(range(1, len(ids) + 1))), st.lists(st.one_of(st.integers(-2, 8), ints32),
                                                                                  max_size=6)))
        width = max(len(ids), len(offsets), 1)
        return [(ids + [-1] * width)[:width], (offsets + [-1] * width)[:width]]  # [2, width]
    if name == "embedding_bias":
        n = draw(st.sampled_from([0, 1, 5, VOCAB, VOCAB + 1, 300]))
        vals = draw(st.lists(floats32, min_size=1, max_size=4))
        return [vals[i % len(vals)] if i % 97 == 0 else 0.0 for i in range(n)] if n else []
    if name in ("stop_words", "bad_words", "embedding_bias_words", "image"):
        many = draw(st.sampled_from([0, 1, 3, 1000]))
        if many == 1000:
            return [b"w%d" % i for i in range(many)]
        return draw(st.lists(texts(2048), min_size=many, max_size=many))
    if name == "embedding_bias_weights":
        return draw(st.lists(floats32, max_size=4))
    if name == "guided_decoding_guide_type":
        return [draw(st.sampled_from(GUIDE_TYPES + ("", "JSON", "lark", "x" * 100))).encode()]
    if name == "guided_decoding_guide":
        return [draw(guides())[1].encode("utf-8", "surrogatepass")]
    if name == "sampling_parameters":
        return [draw(sampling_parameters())]
    if name == "stop":
        return [draw(st.booleans())]
    if dt == "TYPE_BOOL":
        return [draw(st.booleans())]
    if dt == "TYPE_FP32":
        return [draw(floats32)]
    if dt == "TYPE_INT32":
        return [draw(ints32)]
    if dt == "TYPE_UINT64":
        return [draw(uint64s)]
    return [draw(texts(256))]


def _row_shape(spec: Spec, row: list, name: str) -> tuple[int, ...]:
    if name in ("stop_words_list", "bad_words_list"):
        return (2, len(row[0]))
    if spec.dims == (1,):
        return (1,)
    return (len(row),)


@st.composite
def tensor(draw, name: str, spec: Spec, batch: Optional[int]) -> np.ndarray:
    """One input tensor: mostly the declared dtype and shape with drawn values; sometimes a wrong dtype
    or a wrong shape. `batch` None: a max_batch_size 0 model (no batch dimension). Values are sane
    (two thirds) or hostile."""
    row = draw(st.one_of(sane_row(name, spec), sane_row(name, spec), row_values(name, spec)))
    if name in ("stop_words_list", "bad_words_list"):
        flat = [v for part in row for v in part]
    else:
        flat = row
    shape = _row_shape(spec, row, name)
    full = shape if batch is None else (batch, *shape)
    dtype = NP[spec.dtype]
    mutation = draw(st.sampled_from(["none"] * 18 + ["dtype", "shape"]))
    if mutation == "dtype":
        dtype = draw(st.sampled_from([d for d in WRONG_DTYPES if d is not NP[spec.dtype]]))
    elif mutation == "shape":
        full = draw(st.sampled_from([(1, 0), (0, 1), (0,), (1,), (1, 1, 1), (2, 1), (1, 2), (1, 3), (65, 1), (3,),
                                     (1, 1, 0), (2, 2, 2)]))
    return _array(flat, dtype, tuple(full))


@st.composite
def triton_case(draw, model: str) -> Case:
    """Raw tensors for one of the three served names."""
    iface = INTERFACES[model]
    specs = {s.name: s for s in iface.inputs}
    batch: Optional[int] = None
    if iface.max_batch_size:
        batch = draw(st.sampled_from([1] * 24 + [2, 2, 3, 3, 64, 65]))
    names: list[str] = []
    prompt = "text_input" if model == VLLM else draw(st.sampled_from(["text_input"] * 4 + ["input_ids", "both", "none"]))
    if prompt == "both":
        names += ["text_input", "input_ids"]
    elif prompt != "none":
        names.append(prompt)
    if model != VLLM and draw(st.integers(0, 9)):
        names.append(draw(st.sampled_from(sorted(LENGTH_NAMES))))
    names += draw(st.lists(st.sampled_from(sorted(specs)), max_size=5, unique=True))
    if model == VLLM and "sampling_parameters" not in names and draw(st.integers(0, 3)):
        names.append("sampling_parameters")
    guide_names = ("guided_decoding_guide_type", "guided_decoding_guide")
    if model != VLLM and draw(st.integers(0, 2)) == 0:  # a guide in a third of the requests
        names += list(guide_names)
    paired = model != VLLM and any(n in names for n in guide_names) and draw(st.integers(0, 5)) > 0
    out: dict[str, np.ndarray] = {}
    if paired:  # a type and its guide, sane or hostile, as a client sends them
        gtype, text = draw(guides())
        for n, v in zip(guide_names, (gtype, text)):
            out[n] = _array([v.encode("utf-8", "surrogatepass")], np.object_, (batch or 1, 1))
        names = [n for n in names if n not in guide_names]
    for name in dict.fromkeys(names):
        if name not in specs:
            continue
        b = batch
        if b is not None and b > 3 and name == "text_input":
            # many rows are cheap only with short prompts
            out[name] = _array([draw(texts(64, long=False))], np.object_, (b, 1))
            continue
        out[name] = draw(tensor(name, specs[name], b))
    for name in draw(st.lists(st.sampled_from(UNKNOWN_NAMES), max_size=2, unique=True)) if draw(st.integers(0, 15)) == 0 else []:
        spec = specs.get(name) or Spec(name, "TYPE_INT32", (1,), "", "")
        out[name] = draw(tensor(name, spec, batch))
    if model != VLLM and not any(n in out for n in LENGTH_NAMES) and "sampling_parameters" not in out \
            and draw(st.integers(0, 5)):
        out["max_tokens"] = _array([draw(st.integers(1, 8))], np.int32, (batch or 1, 1))
    rid = draw(st.sampled_from(["", "", "", "fuzz", "1", "x" * 300, "\u00e9", "victim-no"]))
    return Case(model, out, request_id=rid)


# ------------------------------------------------------------------------------ Triton HTTP

@st.composite
def http_case(draw) -> Case:
    """Triton's HTTP generate / generate_stream: JSON values per key (right and wrong types), raw text."""
    model = draw(st.sampled_from([ENGINE, UNARY, VLLM]))
    specs = {s.name: s for s in INTERFACES[model].inputs}
    stream = model != UNARY and draw(st.booleans())
    path = f"/v2/models/{model}/{'generate_stream' if stream else 'generate'}"
    if draw(st.integers(0, 9)) == 0:
        body = draw(st.one_of(st.sampled_from([b"", b"{", b"[]", b"null", b'{"text_input": }', b"\xff\xfe",
                                               nested(100_000).encode(), b'{"text_input": "a", "text_input": "b"}']),
                              st.binary(max_size=32)))
        return Case("http", path=path, body=body, stream=stream)
    d: dict[str, Any] = {"text_input": draw(st.one_of(st.sampled_from(["Hi", "The capital of France is", ""]),
                                                      st.text(max_size=24), json_values))}
    if model == VLLM:
        d["sampling_parameters"] = draw(sampling_parameters()).decode("utf-8", "replace")
    else:
        d["max_tokens"] = cheap(draw(st.one_of(lengths, json_values)))
    for name in draw(st.lists(st.sampled_from(sorted(specs) + list(UNKNOWN_NAMES)), max_size=4, unique=True)):
        spec = specs.get(name)
        if spec is None:
            d[name] = draw(json_values)
            continue
        right = draw(row_values(name, spec))
        right = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in right]
        value = right[0] if spec.dims == (1,) and len(right) == 1 else right
        d[name] = draw(st.one_of(st.just(value), st.just(value), json_values))
    text = json.dumps(d, allow_nan=True)
    return Case("http", path=path, body=text.encode("utf-8", "surrogatepass"), stream=stream)


# ------------------------------------------------------------------------------ OpenAI

def _tool(name: Any, params: Any) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


schemas_any = st.one_of(st.sampled_from([json.loads(t) for g, t in SAMPLES if g == "json_schema"]),
                        hostile_schemas.map(lambda t: _maybe_json(t)), json_values)


def _maybe_json(t: str) -> Any:
    try:
        return json.loads(t)
    except (ValueError, RecursionError):
        return t


tools = st.one_of(
    st.lists(st.builds(_tool, st.one_of(st.sampled_from(["get_weather", "f", "a" * 64, "a" * 65, "bad name", ""]),
                                        json_scalars), schemas_any), max_size=3),
    st.builds(lambda n: [_tool(f"t{i}", {"type": "object"}) for i in range(n)], st.sampled_from([100, 2000])),
    json_values,
)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                                    "content": st.one_of(st.text(max_size=24), st.none(), st.just(""),
                                                         st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                         "text": st.text(max_size=8)}),
                                                                  max_size=2), json_values)}),
             min_size=0, max_size=3),
    st.builds(lambda n: [{"role": "user", "content": "hi"}] * n, st.sampled_from([200, 5000])),
    st.builds(lambda n: [{"role": "user", "content": "w " * n}], st.sampled_from([1000, 20000])),
    json_values,
)
prompts = st.one_of(
    st.text(max_size=24), st.sampled_from(["", "Hi", "<|im_start|>", "x" * 40000]),
    st.lists(st.text(max_size=8), max_size=4), st.lists(token_ids, max_size=6),
    st.lists(st.lists(token_ids, max_size=4), max_size=3),
    st.builds(lambda n: ["a"] * n, st.sampled_from([16, 64, 512])),
    json_values,
)


SANE_SCHEMAS = [json.loads(t) for g, t in SAMPLES if g == "json_schema"][:12]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def openai_sane(f: str, chat: bool) -> st.SearchStrategy[Any]:
    """A value the OpenAI server accepts for field `f` (cheap: at most 8 tokens)."""
    if f in VLLM_KEYS and f not in ("logprobs", "n", "best_of", "prompt_logprobs", "structured_outputs"):
        return vllm_sane(f)
    sane: dict[str, st.SearchStrategy[Any]] = {
        "n": st.integers(1, 3), "best_of": st.none(), "prompt_logprobs": st.integers(0, 3),
        "logprobs": st.booleans() if chat else st.integers(0, 5), "top_logprobs": st.integers(0, 5),
        "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "out", "schema": s}}, st.sampled_from(SANE_SCHEMAS))),
        "guided_json": st.sampled_from(SANE_SCHEMAS), "guided_regex": st.sampled_from(["[0-9]{3}", "(yes|no)"]),
        "guided_choice": st.just(["yes", "no"]), "guided_grammar": st.just('root ::= "yes" | "no"'),
        "structured_outputs": structured_outputs(hostile=False), "echo": st.booleans(), "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "num_draft_tokens": st.integers(0, 4), "user": st.just("u1"),
        "tools": st.just([WEATHER]), "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "parallel_tool_calls": st.booleans(), "max_completion_tokens": st.integers(1, 8),
    }
    return sane.get(f, json_scalars)


def openai_hostile(f: str) -> st.SearchStrategy[Any]:
    if f == "n":
        return st.one_of(st.sampled_from([16, 17, 0, -1, 10**6]), json_scalars)
    if f in ("stop", "logit_bias", "stop_token_ids", "bad_words", "temperature", "top_p", "min_p", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "structured_outputs"):
        return vllm_hostile(f)
    if f == "response_format":
        return st.one_of(st.just({"type": "x"}), st.builds(
            lambda s, n: {"type": "json_schema", "json_schema": {"name": n, "schema": s}}, schemas_any,
            st.sampled_from(["out", "", "a b", "x" * 65])), json_values)
    if f == "guided_json":
        return schemas_any
    if f == "guided_regex":
        return hostile_regexes
    if f == "guided_grammar":
        return hostile_grammars
    if f == "guided_choice":
        return st.one_of(st.lists(st.text(max_size=6), max_size=4), json_values,
                         st.builds(lambda n: [f"c{i}" for i in range(n)], st.sampled_from([1000, 100_000])))
    if f == "tools":
        return tools
    if f == "tool_choice":
        return st.one_of(st.just({"type": "function", "function": {"name": "nope"}}), json_values)
    if f in ("top_k", "seed", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "num_draft_tokens",
             "best_of", "max_completion_tokens"):
        return st.one_of(ints32, st.integers(-(2**70), 2**70), json_scalars).map(cheap)
    return json_values


@st.composite
def openai_case(draw, chat: Optional[bool] = None) -> Case:
    """A /v1/completions or /v1/chat/completions body: every field sane (two thirds) or hostile, now
    and then a body that is not a JSON object at all."""
    chat = draw(st.booleans()) if chat is None else chat
    path = "/v1/chat/completions" if chat else "/v1/completions"
    target = "openai_chat" if chat else "openai_completions"
    if draw(st.integers(0, 19)) == 0:
        body = draw(st.one_of(st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe", nested(100).encode(),
                                               nested(100_000, "object").encode(), escaped_quotes(24000).encode(),
                                               b'{"model": "specguide", "prompt": "a", "max_tokens": 1e999}']),
                              st.binary(max_size=32)))
        return Case(target, path=path, body=body)
    d: dict[str, Any] = {"model": draw(st.sampled_from(["specguide"] * 30 + ["", "gpt-4", "specguide_vllm", None]))}
    hostile = st.sampled_from([False, False, True])
    if chat:
        d["messages"] = draw(messages) if draw(hostile) else [{"role": "user", "content": draw(
            st.sampled_from([p.decode() for p in SANE_PROMPTS]))}]
    else:
        d["prompt"] = draw(prompts) if draw(hostile) else draw(st.sampled_from([p.decode() for p in SANE_PROMPTS]))
    # (null is OpenAI's "as many as fit": up to max_seq_len here; sent as 8)
    d["max_tokens"] = cheap(draw(st.one_of(lengths, json_scalars.filter(lambda v: v is not None)))) \
        if draw(hostile) else draw(st.integers(1, 8))
    fields = ["n", "stop", "logit_bias", "response_format", "temperature", "top_p", "top_k", "min_p", "seed",
              "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
              "bad_words", "ignore_eos", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs", "logprobs", "echo", "stream", "stream_options", "num_draft_tokens", "best_of",
              "user", "prompt_logprobs", "suffix", "extra_field", "include_stop_str_in_output"]
    if chat:
        fields += ["tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "max_completion_tokens",
                   "chat_template_kwargs", "functions", "reasoning_effort"]
    for f in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        d[f] = draw(openai_hostile(f)) if draw(hostile) else draw(openai_sane(f, chat))
    if "max_completion_tokens" in d:
        d["max_completion_tokens"] = cheap(d["max_completion_tokens"]) if d["max_completion_tokens"] is not None else 8
    stream = d.get("stream") is True
    return Case(target, path=path, body=json.dumps(d, allow_nan=True).encode("utf-8", "surrogatepass"), stream=stream)


def cases(targets: tuple[str, ...] = TARGETS) -> st.SearchStrategy[Case]:
    """Any hostile request to any of `targets`."""
    by = {ENGINE: triton_case(ENGINE), UNARY: triton_case(UNARY), VLLM: triton_case(VLLM), "http": http_case(),
          "openai_completions": openai_case(chat=False), "openai_chat": openai_case(chat=True)}
    return st.one_of(*[by[t] for t in targets])


# ------------------------------------------------------------------------------ the measured attacks and the fuzzer's finds

def known_attacks(victim_first_token: int, victim_prompt: str) -> list[Case]:
    """Issue 75's measured attacks and code-read findings, and what the fuzzer found (FOUND), as cases
    (run before the drawn ones): each must get a clear error or a valid answer and harm no victim,
    like any other."""
    quotes = escaped_quotes(24000)  # 48 KB: the depth scan held the GIL for seconds (quadratic)
    one = lambda v, dt=np.int32: np.array([[v]], dtype=dt)  # noqa: E731
    return [
        # a bad word whose first token the running streams write, then an id past the vocabulary
        Case(ENGINE, {"text_input": one(victim_prompt.encode(), np.object_), "max_tokens": one(8),
                      "bad_words_list": np.array([[[victim_first_token, 999999], [2, -1]]], dtype=np.int32)}),
        Case("http", path=f"/v2/models/{ENGINE}/generate", body=json.dumps(
            {"text_input": "Hi", "max_tokens": 4, "guided_decoding_guide_type": "json_schema",
             "guided_decoding_guide": quotes}).encode()),
        Case(VLLM, {"text_input": np.array([b"Hi"], dtype=np.object_),
                    "sampling_parameters": np.array([quotes.encode()], dtype=np.object_)}),
        Case(ENGINE, {"text_input": one(b"Hi", np.object_), "max_tokens": one(4),
                      "sampling_parameters": one(('{"max_tokens": 4, "stop": ' + quotes + "}").encode(), np.object_)}),
        Case("openai_completions", path="/v1/completions", body=json.dumps(
            {"model": "specguide", "prompt": ["a"] * 20000, "max_tokens": 1}).encode()),
        Case("openai_completions", path="/v1/completions", body=('{"model": "specguide", "prompt": "Hi", "max_tokens": 1, '
                                                                 '"stop": ' + quotes + "}").encode()),
        # stop token ids past the vocabulary; many stop strings and bad words (no count caps)
        Case(VLLM, {"text_input": np.array([b"Hi"], dtype=np.object_), "sampling_parameters": np.array(
            [b'{"max_tokens": 4, "stop_token_ids": [999999, -5]}'], dtype=np.object_)}),
        Case(VLLM, {"text_input": np.array([victim_prompt.encode()], dtype=np.object_), "sampling_parameters": np.array(
            [json.dumps({"max_tokens": 8, "stop": [f"s{i} x" for i in range(20000)],
                         "bad_words": [f"w{i} y" for i in range(5000)]}).encode()], dtype=np.object_)}),
        # guides whose shortest completion is huge (built on the engine loop for the budget)
        Case(ENGINE, {"text_input": one(b"List.", np.object_), "max_tokens": one(8),
                      "guided_decoding_guide_type": one(b"json_schema", np.object_),
                      "guided_decoding_guide": one(_nested_min_items(4, 4000).encode(), np.object_)}),
        Case(ENGINE, {"text_input": one(b"Say a.", np.object_), "max_tokens": one(8),
                      "guided_decoding_guide_type": one(b"regex", np.object_),
                      "guided_decoding_guide": one(b"(a{4000}){4000}", np.object_)}),
    ] + FOUND


def _guided(prompt: bytes, gtype: str, guide: str, max_tokens: int = 8) -> Case:
    one = lambda v, dt=np.object_: np.array([[v]], dtype=dt)  # noqa: E731
    return Case(ENGINE, {"text_input": one(prompt), "max_tokens": one(max_tokens, np.int32),
                         "guided_decoding_guide_type": one(gtype.encode()), "guided_decoding_guide": one(guide.encode())})


# what bench_fuzz found (bench/RESULTS.md, "Fuzzing"); each once answered with an internal error
FOUND = [
    # xgrammar's jump-forward string cut inside a UTF-8 character (the drafter's forced tokens):
    # "decode failed (UnicodeDecodeError; the server log has the details)"
    _guided(b"Hi", "regex", "\u00c1\u00fb\u00f2\x15k_"),
    _guided(b"Hi", "regex", "\u00c1\u00fb"),
    _guided(b"Hi", "choice", '["\u00c1\u00fb\u00f2"]'),  # any non-ASCII literal an xgrammar guide forces
    _guided(b"Hi", "ebnf_grammar", 'root ::= "\u00c1\u00fb\u00f2"'),
    _guided(b"Hi", "regex", "\u4e2d\u6587\u5b57"),
    Case("openai_chat", path="/v1/chat/completions", body=json.dumps(  # 500 there
        {"model": "specguide", "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 8,
         "guided_choice": ["\u00e9t\u00e9", "hiver"]}).encode()),
]
