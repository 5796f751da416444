"""Issue 19: input caps before any work, exact messages, edge values of sampling parameters."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specguide.config import EngineConfig
from specguide.guided.limits import GuideLimits, check_guide, json_depth, measure
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError, SamplingParams, error_code
from specguide.triton.input_limits import InputLimits
from specguide.triton.request_inputs import read_parameters
from specguide.triton.request_parser import parse_request


class CountingTokenizer:
    """Bytes as tokens; counts calls and the bytes it was given."""

    def __init__(self):
        self.calls, self.bytes = 0, 0

    def encode(self, text):
        self.calls += 1
        self.bytes += len(text)
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def s(v):
    return np.array([[v.encode() if isinstance(v, str) else v]], dtype=np.object_)


def parse(inputs, tok=None, **kw):
    kw.setdefault("max_tokens_limit", 2048)
    return parse_request(inputs, {}, tokenizer=tok or CountingTokenizer(), **kw)


def error(inputs, **kw) -> str:
    with pytest.raises(InvalidRequestError) as e:
        parse(inputs, **kw)
    assert error_code(e.value) == "INVALID_ARG"
    return str(e.value)


# ------------------------------------------------------------------ prompt caps, tokenize once


def test_a_huge_prompt_is_refused_by_bytes_before_tokenizing():
    tok = CountingTokenizer()
    limits = InputLimits.from_config(EngineConfig(max_seq_len=2048))
    assert limits.max_prompt_bytes == 16 * 2048
    with pytest.raises(InvalidRequestError) as e:
        parse({"text_input": s("x" * 5_000_000)}, tok=tok, limits=limits)
    assert tok.calls == 0  # nothing was tokenized: refused by its bytes (no clock: CPUs differ)
    msg = str(e.value)
    assert "text_input has 5000000 bytes" in msg and "32768" in msg and "max_prompt_bytes" in msg


def test_a_text_prompt_is_tokenized_once_and_the_echo_reuses_the_ids():
    tok = CountingTokenizer()
    (p,) = parse({"text_input": s("hello world"), "exclude_input_in_output": np.array([[False]])}, tok=tok)
    assert tok.calls == 1 and tok.bytes == len("hello world")
    assert p.request.prompt_ids == list(b"hello world") and p.echo_ids == list(b"hello world")
    assert p.echo_text == "hello world"


def test_input_ids_longer_than_max_seq_len_are_refused_before_anything_else():
    msg = error({"input_ids": np.zeros((1, 300), np.int32)}, limits=InputLimits(max_prompt_tokens=256))
    assert "input_ids has 300 tokens; max_seq_len is 256" in msg


@pytest.mark.parametrize("name", ["sampling_parameters", "stop_words", "bad_words"])
def test_json_and_word_inputs_are_capped_by_bytes(name):
    msg = error({"text_input": s("a"), name: s("x" * 5000)}, limits=InputLimits(max_json_bytes=4096))
    assert f"{name} has 5000 bytes" in msg and "max_sampling_parameters_bytes" in msg


def test_request_parameters_are_capped_by_bytes():
    class Req:
        def parameters(self):
            return json.dumps({"temperature": 0.5, "pad": "x" * 5000})

    with pytest.raises(InvalidRequestError, match="the request parameters has 50.. bytes.*max_sampling_parameters_bytes"):
        read_parameters(Req(), InputLimits(max_json_bytes=4096))


def test_a_guide_tensor_is_capped_by_bytes():
    msg = error({"text_input": s("a"), "guided_decoding_guide_type": s("regex"),
                 "guided_decoding_guide": s("a" * 5000)}, limits=InputLimits(max_guide_bytes=4096))
    assert "guided_decoding_guide has 5000 bytes" in msg and "guided_max_guide_bytes" in msg


# ------------------------------------------------------------------ exact messages


def test_deeply_nested_sampling_parameters_name_the_depth_not_recursion():
    deep = "[" * 10_000 + "]" * 10_000
    msg = error({"text_input": s("a"), "sampling_parameters": s('{"stop": ' + deep + "}")})
    assert "sampling_parameters is nested 10001 levels deep; the limit is 72" in msg
    assert "guided_max_nesting_depth" in msg and "recursion" not in msg


def test_a_schema_nested_600_deep_names_the_depth():
    text = '{"type": "object", "properties": {"a": ' * 600 + '{"type": "integer"}' + "}}" * 600
    msg = error({"text_input": s("a"), "guided_decoding_guide_type": s("json_schema"),
                 "guided_decoding_guide": s(text)})
    assert "is nested 1201 levels deep; the limit is 64" in msg and "guided_max_nesting_depth" in msg
    # the same schema through vLLM's structured_outputs: refused by the sampling_parameters depth
    msg = error({"text_input": s("a"), "sampling_parameters": s('{"structured_outputs": {"json": ' + text + "}}")})
    assert "nested" in msg and "recursion" not in msg


@pytest.mark.parametrize("stop, words", [
    (5, "got a number"), ({"x": 1}, "got an object"), (True, "got a boolean"), ([1], "each stop string must be a string"),
])
def test_stop_must_be_a_string_or_a_list_of_strings(stop, words):
    msg = error({"text_input": s("a"), "sampling_parameters": s(json.dumps({"stop": stop}))})
    assert "stop" in msg and words in msg and "iterable" not in msg


def test_a_stop_string_and_a_list_still_work():
    (p,) = parse({"text_input": s("a"), "sampling_parameters": s(json.dumps({"stop": "END"}))})
    assert p.request.params.stop == ["END"]
    (p,) = parse({"text_input": s("a"), "sampling_parameters": s(json.dumps({"stop": ["A", "B"]}))})
    assert p.request.params.stop == ["A", "B"]


def test_stop_token_ids_and_bad_words_must_be_lists():
    assert "stop_token_ids must be a list, got a number" in error(
        {"text_input": s("a"), "sampling_parameters": s(json.dumps({"stop_token_ids": 5}))})
    assert "bad_words must be a list, got an object" in error(
        {"text_input": s("a"), "sampling_parameters": s(json.dumps({"bad_words": {"x": 1}}))})


# ------------------------------------------------------------------ edge values


def test_tiny_temperature_is_greedy_and_small_ones_are_raised_like_vllm():
    p = SamplingParams(temperature=1e-40)
    p.normalize(vocab_size=100)
    assert p.temperature == 0.0 and p.greedy
    p = SamplingParams(temperature=1e-3)
    p.normalize(vocab_size=100)
    assert p.temperature == 1e-2 and not p.greedy
    p = SamplingParams(temperature=0.7)
    p.normalize(vocab_size=100)
    assert p.temperature == 0.7


def test_top_k_past_the_vocabulary_is_off():
    (p,) = parse({"text_input": s("a"), "sampling_parameters": s(json.dumps({"top_k": 1e30}))})
    sp = p.request.params
    sp.normalize(vocab_size=49152)
    assert sp.top_k == 0
    sp = SamplingParams(top_k=40)
    sp.normalize(vocab_size=49152)
    assert sp.top_k == 40


@pytest.mark.parametrize("value", [1e-38, 0.001, 1e3])
def test_repetition_penalty_outside_its_finite_range_is_refused(value):
    msg = error({"text_input": s("a"), "repetition_penalty": np.array([[value]], np.float32)})
    assert "repetition_penalty must be in [0.01, 100]" in msg


def test_repetition_penalty_at_the_range_ends_is_accepted():
    for v in (0.01, 100.0):
        (p,) = parse({"text_input": s("a"), "sampling_parameters": s(json.dumps({"repetition_penalty": v}))})
        assert p.request.params.repetition_penalty == v


# ------------------------------------------------------------------ guide limits


def optional_props(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


def test_guide_measurements():
    size = measure(G("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 300},
        "b": {"type": "object", "properties": {"c": {"type": "string", "pattern": "[a-z]{2,900}"}}}}})))
    assert (size.properties, size.depth, size.repetition) == (3, 5, 900)
    assert measure(G("regex", "[0-9]{3}-[0-9]{4,12}")).repetition == 12
    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3  # brackets inside strings do not count
    assert measure(G("regex", "[0-9]{3}")).small() and not measure(G("json_schema", optional_props(200))).small()


@pytest.mark.parametrize("params, limits, words", [
    (G("json_schema", optional_props(3500)), GuideLimits(), "has 3500 object properties (all levels); the limit is 1000"),
    (G("regex", "a{100000}"), GuideLimits(), "repetition bound of 100000"),
    (G("json_schema", json.dumps({"type": "string", "maxLength": 10 ** 9})), GuideLimits(), "repetition bound of 1000000000"),
    (G("regex", "a" * 300), GuideLimits(max_bytes=256), "has 300 bytes; the limit is 256"),
])
def test_guide_limits_name_the_limit_and_the_setting(params, limits, words):
    with pytest.raises(InvalidRequestError) as e:
        check_guide(params, limits)
    msg = str(e.value)
    assert words in msg and "guided_max_" in msg and "config.pbtxt" in msg


def test_zero_turns_a_guide_limit_off():
    check_guide(G("json_schema", optional_props(1200)), GuideLimits(max_properties=0))
