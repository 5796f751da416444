"""vLLM's `sampling_parameters` JSON (`sampling_parameters`): every key with a sane or hostile value
(`vllm_sane`, `vllm_hostile`), unknown keys, `structured_outputs` / `guided_decoding` guides, deep
nesting, odd numbers, escaped-quote runs and text that is not JSON."""
from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

from .case import JSON_BYTES_CAP, VOCAB
from .guides import guides
from .primitives import (FLOAT_EXTREMES, cheap, escaped_quotes, floats32, ints32, json_scalars, json_values,
                         lengths, nested, odd_json_numbers, texts, token_ids)

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
