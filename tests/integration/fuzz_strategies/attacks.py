"""Issue 75's measured attacks, its code-read findings and what the fuzzer found (`FOUND`), as fixed
cases (`known_attacks`) sent before the drawn ones."""
from __future__ import annotations

import json

import numpy as np

from .case import ENGINE, VLLM, Case
from .guides import nested_min_items
from .primitives import escaped_quotes

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
                      "guided_decoding_guide": one(nested_min_items(4, 4000).encode(), np.object_)}),
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
    # a choice the vocabulary cannot write past its first character (SmolLM2 has no token for byte
    # F2, the lead byte of U+B0CC5): "token 0 violates the grammar", 500 (INTERNAL); now 400
    Case("openai_chat", path="/v1/chat/completions", body=json.dumps(
        {"model": "specguide", "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 8,
         "guided_choice": ["b\U000B0CC5"]}).encode()),
    _guided(b"Hi", "choice", '["b\U000B0CC5"]'),
    # a grammar with no way to end: its first mask is empty; answered 500 ("token 0 violates the
    # grammar") after a step
    _guided(b"Hi", "ebnf_grammar", "root ::= x\nx ::= y\ny ::= x"),
    Case("openai_completions", path="/v1/completions", body=json.dumps(
        {"model": "specguide", "prompt": "Say yes.", "max_tokens": 8,
         "guided_grammar": "root ::= x\nx ::= y\ny ::= x"}).encode()),
    # a JSON schema given as a string nested thousands of levels deep: its parse recursed past
    # Python's limit (RecursionError, 500); now 400 before the parse
    Case("openai_completions", path="/v1/completions", body=json.dumps(
        {"model": "specguide", "prompt": "Say yes.", "max_tokens": 3,
         "guided_json": "[" * 20000 + "]" * 20000}).encode()),
]
