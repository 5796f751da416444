"""specguide.triton's request reading and parsing (request_inputs, request_parser, trtllm_params,
vllm_params): Triton tensors and parameters -> engine requests, against a fake of
triton_python_backend_utils (no server needed)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specguide.request import InvalidRequestError, QueueFullError, error_code
from specguide.triton.interfaces import INTERFACE_PARAMETER
from specguide.triton.request_inputs import interface_of, is_stop_request
from specguide.triton.responses import UnsupportedError, error_response
from triton_fakes import FakeTritonError, f32, one, parse, pb, s, vllm, vparse, vtext


# ---------------------------------------------------------------------------------- TensorRT-LLM tensors and the vLLM JSON


def test_minimal_text_request_gets_trtllm_defaults():
    p = one({"text_input": s("Hello")}, default_max_tokens=64)
    r = p.request
    assert r.prompt == "Hello" and r.prompt_ids == list(b"Hello")  # tokenized once, here (the fake: bytes)
    assert r.params.max_tokens == 64
    assert r.params.greedy and r.params.temperature == 0.0
    assert r.params.stop == [] and r.params.seed is None
    assert r.guided is None and r.num_draft_tokens is None
    assert p.stream is False
    assert p.exclude_input is False and p.echo_text == "Hello"  # non-streaming echoes the prompt by default
    assert p.batch_index == 0


def test_streaming_excludes_input_by_default():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]])})
    assert p.stream and p.exclude_input and p.echo_text == ""


def test_all_trtllm_tensors_map_to_sampling_params():
    p = one({
        "text_input": s("Hi"),
        "max_tokens": np.array([[7]], np.int32),
        "min_tokens": np.array([[2]], np.int32),
        "temperature": np.array([[0.5]], np.float32),
        "top_k": np.array([[40]], np.int32),
        "top_p": np.array([[0.9]], np.float32),
        "seed": np.array([[2**63 + 5]], np.uint64),
        "stop_words": s("\n\n", "", "END"),
        "bad_words": s("ab"),
        "end_id": np.array([[2]], np.int32),
        "pad_id": np.array([[0]], np.int32),
        "num_draft_tokens": np.array([[0]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
        "return_num_input_tokens": np.array([[True]]),
        "return_num_output_tokens": np.array([[True]]),
        "return_perf_metrics": np.array([[True]]),
        "beam_width": np.array([[1]], np.int32),
        "frequency_penalty": np.array([[0.25]], np.float32),
        "presence_penalty": np.array([[-0.5]], np.float32),
        "repetition_penalty": np.array([[1.5]], np.float32),
        "length_penalty": np.array([[1.3]], np.float32),
    })
    sp = p.request.params
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.5, -0.5, 0.25)
    assert sp.penalized
    assert (sp.max_tokens, sp.min_tokens, sp.top_k, sp.seed, sp.end_id) == (7, 2, 40, 2**63 + 5, 2)
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    # stop words are token sequences kept in the output (TensorRT-LLM); empty strings are skipped
    assert sp.stop == [] and sp.stop_token_seqs == [[10, 10], [69, 78, 68]]
    assert sp.bad_words_ids == [[97, 98]]
    assert p.request.num_draft_tokens == 0
    assert p.exclude_input and p.return_num_input_tokens and p.return_num_output_tokens and p.return_perf_metrics


@pytest.mark.parametrize("name,value,dtype", [("top_p", 0.8, np.float32), ("top_k", 5, np.int32)])
def test_any_sampling_knob_turns_on_sampling_with_temperature_1(name, value, dtype):
    sp = one({"text_input": s("Hi"), name: np.array([[value]], dtype)}).request.params
    assert sp.temperature == 1.0 and not sp.greedy


def test_aliases_min_length_and_random_seed():
    sp = one({"text_input": s("Hi"), "min_length": np.array([[3]], np.int32),
              "random_seed": np.array([[11]], np.uint64)}).request.params
    assert sp.min_tokens == 3 and sp.seed == 11


def test_input_ids_with_lengths():
    p = one({"input_ids": np.array([[5, 6, 7, 0]], np.int32), "input_lengths": np.array([[3]], np.int32)})
    assert p.request.prompt_ids == [5, 6, 7] and p.request.prompt is None
    assert p.echo_ids == [5, 6, 7]


def test_batch_rows_become_sequences_with_their_own_values():
    rows = parse({
        "text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
        "max_tokens": np.array([[3], [4]], np.int32),
    })
    assert [r.request.prompt for r in rows] == ["a", "b"]
    assert [r.request.params.max_tokens for r in rows] == [3, 4]
    assert [r.batch_index for r in rows] == [0, 1]


def test_request_parameters_fill_missing_scalars():
    p = one({"text_input": s("Hi")}, parameters=json.dumps({"max_tokens": 5, "temperature": 0.0, "Streaming": True}))
    assert p.request.params.max_tokens == 5
    with pytest.raises(InvalidRequestError, match="unknown request parameter 'unrelated'"):
        parse({"text_input": s("Hi")}, parameters=json.dumps({"max_tokens": 5, "unrelated": "x"}))


def test_vllm_sampling_parameters_with_string_values_and_vllm_defaults():
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"min_tokens": "2", "top_k": -1}))}).request.params
    assert sp.max_tokens == 16 and sp.temperature == 1.0 and sp.top_k == 0 and sp.min_tokens == 2
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({
        "max_tokens": "8", "temperature": 0, "stop": "x", "stop_token_ids": [1, 2], "ignore_eos": True,
        "seed": 3, "n": 1, "frequency_penalty": 0.0, "lora_name": None}))}).request.params
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.seed) == (8, 0.0, ["x"], [1, 2], True, 3)
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"min_p": "0.05", "logit_bias": {"7": -100}}))}).request.params
    assert sp.logit_bias == {7: -100.0} and sp.min_p == 0.05 and not sp.greedy and not sp.include_stop_str_in_output
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"include_stop_str_in_output": "true"}))}).request.params
    assert sp.include_stop_str_in_output
    for bad, message in ((dict(min_p=1.5), "min_p must be in"), (dict(min_p=-0.1), "min_p must be in"),
                         (dict(logit_bias={"x": 1}), "logit_bias keys"), (dict(logit_bias={"1": 500}), "logit_bias values"),
                         (dict(logit_bias=[1]), "logit_bias must be")):
        with pytest.raises(InvalidRequestError, match=message) as e:
            parse({"text_input": s("Hi"), "sampling_parameters": s(json.dumps(bad))})
        assert error_code(e.value) == "INVALID_ARG"


def test_penalties_map_from_tensors_and_vllm_json():
    # a penalty alone keeps the request greedy (only temperature/top_k/top_p turn sampling on)
    sp = one({"text_input": s("Hi"), "repetition_penalty": np.array([[1.5]], np.float32)}).request.params
    assert sp.repetition_penalty == 1.5 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
    assert sp.greedy and sp.penalized
    for name in ("presence_penalty", "frequency_penalty"):
        sp = one({"text_input": s("Hi"), name: np.array([[-2.0]], np.float32)}).request.params
        assert getattr(sp, name) == -2.0 and sp.greedy
    # neutral values are accepted everywhere and leave the request unpenalized
    sp = one({"text_input": s("Hi"), "repetition_penalty": np.array([[1.0]], np.float32),
              "presence_penalty": np.array([[0.0]], np.float32), "frequency_penalty": np.array([[0.0]], np.float32),
              "sampling_parameters": vllm(repetition_penalty=1, presence_penalty="0", frequency_penalty=0.0)}).request.params
    assert not sp.penalized
    # vLLM keys, numbers or strings (as genai-perf sends them)
    sp = one({"text_input": s("Hi"), "sampling_parameters": vllm(
        repetition_penalty="1.2", presence_penalty=0.5, frequency_penalty="-1.5", temperature=0)}).request.params
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.2, 0.5, -1.5)
    # a tensor overrides the same vLLM key
    sp = one({"text_input": s("Hi"), "sampling_parameters": vllm(repetition_penalty=1.2, presence_penalty=0.5),
              "repetition_penalty": np.array([[2.0]], np.float32)}).request.params
    assert (sp.repetition_penalty, sp.presence_penalty) == (2.0, 0.5)
    # request parameters (gRPC parameters / HTTP generate keys) fill them too
    sp = one({"text_input": s("Hi")}, parameters=json.dumps({"frequency_penalty": 0.75})).request.params
    assert sp.frequency_penalty == 0.75


BAD_PENALTIES = [
    ({"repetition_penalty": f32(0.0)}, "repetition_penalty must be in [0.01, 100]"),
    ({"repetition_penalty": f32(-1.0)}, "repetition_penalty must be in [0.01, 100]"),
    ({"repetition_penalty": f32(np.inf)}, "repetition_penalty must be in [0.01, 100]"),
    ({"repetition_penalty": f32(np.nan)}, "repetition_penalty must be a number"),
    ({"presence_penalty": f32(2.5)}, "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": f32(-3.0)}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": f32(-2.01)}, "frequency_penalty must be in [-2, 2]"),
    ({"frequency_penalty": f32(np.inf)}, "frequency_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(repetition_penalty=0)}, "repetition_penalty must be in [0.01, 100]"),
    ({"sampling_parameters": vllm(presence_penalty="2.5")}, "presence_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(frequency_penalty=-7)}, "frequency_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(repetition_penalty="lots")}, "repetition_penalty must be a number"),
    ({"sampling_parameters": vllm(presence_penalty=True)}, "presence_penalty must be a number"),
    ({"sampling_parameters": vllm(repetition_penalty=1.5), "repetition_penalty": f32(0.0)},
     "repetition_penalty must be in [0.01, 100]"),  # the tensor wins, and is checked
]


@pytest.mark.parametrize("inputs,message", BAD_PENALTIES, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD_PENALTIES)])
def test_bad_penalties_are_invalid_arg(inputs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse({"text_input": s("a"), **inputs})
    assert not isinstance(e.value, UnsupportedError)
    assert error_code(e.value) == "INVALID_ARG"


def test_beam_width_and_length_penalty_unchanged():
    with pytest.raises(UnsupportedError, match="beam_width=4") as e:
        parse({"text_input": s("a"), "beam_width": np.array([[4]], np.int32)})
    assert error_code(e.value) == "UNSUPPORTED"
    one({"text_input": s("a"), "beam_width": np.array([[1]], np.int32), "length_penalty": f32(0.3)})  # ignored
    with pytest.raises(UnsupportedError, match="length_penalty=2.0"):
        parse({"text_input": s("a"), "sampling_parameters": vllm(length_penalty=2.0)})
    with pytest.raises(UnsupportedError, match="use_beam_search=True"):
        parse({"text_input": s("a"), "sampling_parameters": vllm(use_beam_search=True)})


def test_tensors_override_vllm_json():
    sp = one({"text_input": s("Hi"), "sampling_parameters": s('{"max_tokens": 8, "temperature": 0.7}'),
              "max_tokens": np.array([[3]], np.int32)}).request.params
    assert sp.max_tokens == 3 and sp.temperature == pytest.approx(0.7)


BAD_INPUTS = [
    ({}, "missing prompt"),
    ({"text_input": s("")}, "text_input is empty"),
    ({"text_input": s("a"), "input_ids": np.array([[1]], np.int32)}, "not both"),
    ({"input_ids": np.array([[1, 2]], np.int32), "input_lengths": np.array([[5]], np.int32)}, "input_lengths"),
    ({"text_input": s("a"), "max_tokens": np.array([[0]], np.int32)}, "max_tokens"),
    ({"text_input": s("a"), "max_tokens": np.array([[10**6]], np.int32)}, "exceeds the limit"),
    ({"text_input": s("a"), "temperature": np.array([[-1.0]], np.float32)}, "temperature"),
    ({"text_input": s("a"), "top_p": np.array([[1.5]], np.float32)}, "top_p"),
    ({"text_input": s("a"), "sampling_parameters": s('{"top_k": -2}')}, "top_k"),
    ({"text_input": s("a"), "sampling_parameters": s('{"some_future_key": 1}')}, "unknown key 'some_future_key'"),
    ({"text_input": s("a"), "max_tokens": np.array([[3]], np.int32), "request_output_len": np.array([[4]], np.int32)},
     "give either max_tokens or request_output_len"),
    ({"text_input": s("a"), "num_return_sequences": np.array([[0]], np.int32)}, "num_return_sequences"),
    ({"text_input": s("a"), "return_cumulative_logprob": np.array([[True]])}, "input 'return_cumulative_logprob' is not part of"),
    ({"text_input": s("a"), "return_logprobs": np.array([[True]]), "sampling_parameters": s('{"logprobs": 21}')},
     "logprobs must be in [0, 20]"),
    ({"text_input": s("a"), "stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "stop_words_list: offset 3"),
    ({"text_input": s("a"), "min_tokens": np.array([[100]], np.int32)}, "min_tokens"),
    ({"text_input": s("a"), "num_draft_tokens": np.array([[-1]], np.int32)}, "num_draft_tokens"),
    ({"text_input": s("a"), "beam_width": np.array([[4]], np.int32)}, "beam_width"),
    ({"text_input": s("a"), "presence_penalty": np.array([[2.5]], np.float32)}, "presence_penalty"),
    ({"text_input": s("a"), "sampling_parameters": s("{not json")}, "not valid JSON"),
    ({"text_input": s("a"), "sampling_parameters": s("[1]")}, "JSON object"),
    ({"text_input": s("a"), "sampling_parameters": s('{"max_tokens": "many"}')}, "max_tokens must be an integer"),
    ({"text_input": s("a"), "sampling_parameters": s('{"n": 2}')}, "n=2"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("xml"), "guided_decoding_guide": s("x")}, "guide_type must be one of"),
    ({"text_input": s("a"), "guided_decoding_guide": s("{}")}, "is given without guided_decoding_guide_type"),
    ({"text_input": s("a"), "guided_decoding_guide_type": s("regex")}, "guided_decoding_guide is required"),
    ({"text_input": np.array([[b"\xff\xfe"]], dtype=np.object_)}, "UTF-8"),
]


@pytest.mark.parametrize("inputs,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_raise_clear_invalid_request_errors(inputs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse(inputs, max_tokens_limit=1024)
    assert error_code(e.value) in ("INVALID_ARG", "UNSUPPORTED")


def test_guided_inputs_map_to_params():
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s("json_schema"),
             "guided_decoding_guide": s('{"type": "object"}')}).request.guided
    assert (g.guide_type, g.guide) == ("json_schema", '{"type": "object"}')
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s(" Regex "), "guided_decoding_guide": s("[a-z]+")}).request.guided
    assert (g.guide_type, g.guide) == ("regex", "[a-z]+")  # guided.params normalizes the type
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s("json"), "guided_decoding_guide": s("")}).request.guided
    assert (g.guide_type, g.guide) == ("json", "")
    for key in ("structured_outputs", "guided_decoding"):
        for so, expected in [
            ({"json": {"type": "integer"}}, ("json_schema", '{"type": "integer"}')),
            ({"json": '{"type": "string"}'}, ("json_schema", '{"type": "string"}')),
            ({"regex": "[a-z]+"}, ("regex", "[a-z]+")),
            ({"grammar": 'root ::= "x"'}, ("ebnf_grammar", 'root ::= "x"')),
            ({"choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
            ({"json_object": True}, ("json", "")),
            ({"regex": "[0-9]{3}", "backend": "xgrammar", "json": None}, ("regex", "[0-9]{3}")),  # options ignored
        ]:
            for value in (so, json.dumps(so)):  # an object or its JSON string
                g = one({"text_input": s("a"), "sampling_parameters": vllm(**{key: value})}).request.guided
                assert (g.guide_type, g.guide) == expected, (key, value)


def test_guided_mapping_is_guided_params():
    """The parser has no guided mapping of its own: what it returns is guided.params.resolve_guided's answer."""
    from specguide.guided import params as gp

    cases = [
        ("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}', None),
        ("choice", '["a", "b"]', None),
        (None, None, {"structured_outputs": {"choice": ["x", "y"]}}),
        (None, None, {"guided_decoding": {"grammar": 'root ::= "a" | "b"'}}),
    ]
    for gtype, guide, sp in cases:
        inputs = {"text_input": s("a")}
        if gtype:
            inputs.update(guided_decoding_guide_type=s(gtype), guided_decoding_guide=s(guide))
        if sp:
            inputs["sampling_parameters"] = vllm(**sp)
        assert one(inputs).request.guided == gp.resolve_guided(gtype, guide, sp)


GUIDE_T, GUIDE = "guided_decoding_guide_type", "guided_decoding_guide"


BAD_GUIDES = [
    ({GUIDE_T: s("xml"), GUIDE: s("<a/>")}, "guided_decoding_guide_type must be one of"),
    ({GUIDE_T: s("json_schema")}, "guided_decoding_guide is required"),
    ({GUIDE_T: s("json_schema"), GUIDE: s("{not json")}, "json_schema guide is not valid JSON"),
    ({GUIDE_T: s("json_schema"), GUIDE: s("[1, 2]")}, "json_schema must be a JSON object"),
    ({GUIDE_T: s("json"), GUIDE: s('{"type": "object"}')}, "takes no guide"),
    ({GUIDE_T: s("choice"), GUIDE: s("[]")}, "non-empty list of strings"),
    ({GUIDE_T: s("choice"), GUIDE: s("[1]")}, "list of strings"),
    ({GUIDE: s("[0-9]+")}, "is given without guided_decoding_guide_type"),
    ({"sampling_parameters": vllm(structured_outputs={"regex": "a", "choice": ["b"]})}, "give exactly one guide"),
    ({"sampling_parameters": vllm(structured_outputs={"xml": "a"})}, "unknown key(s) ['xml']"),
    ({"sampling_parameters": vllm(guided_decoding={"choise": ["a"]})}, "guided_decoding: unknown key(s)"),
    ({"sampling_parameters": vllm(structured_outputs=[1])}, "structured_outputs must be a JSON object"),
    ({"sampling_parameters": vllm(structured_outputs="{oops")}, "structured_outputs is not valid JSON"),
    ({"sampling_parameters": vllm(structured_outputs={"choice": "yes"})}, "structured_outputs.choice must be a non-empty list"),
    ({"sampling_parameters": vllm(structured_outputs={"json_object": "yes"})}, "json_object must be a boolean"),
    ({"sampling_parameters": vllm(structured_outputs={"regex": ""})}, "guided_decoding_guide is required"),
    ({"sampling_parameters": vllm(structured_outputs={"regex": "a"}, guided_decoding={"regex": "b"})},
     "structured_outputs or guided_decoding, not both"),
    ({GUIDE_T: s("regex"), GUIDE: s("a"), "sampling_parameters": vllm(structured_outputs={"regex": "b"})},
     "give one guide"),
]


@pytest.mark.parametrize("inputs,message", BAD_GUIDES, ids=[m for _, m in BAD_GUIDES])
def test_bad_guides_are_invalid_arg_with_guided_params_messages(inputs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse({"text_input": s("a"), **inputs})
    assert error_code(e.value) == "INVALID_ARG"


def test_vllm_sampling_still_maps_with_a_guide():
    p = one({"text_input": s("a"), "sampling_parameters": vllm(max_tokens="9", temperature=0,
                                                                 structured_outputs={"choice": ["yes", "no"]})})
    assert p.request.params.max_tokens == 9 and p.request.params.greedy
    assert p.request.guided.guide_type == "choice"


def test_error_codes():
    assert error_code(InvalidRequestError("x")) == "INVALID_ARG"
    assert error_code(UnsupportedError("x")) == "UNSUPPORTED"
    assert error_code(QueueFullError("x")) == "UNAVAILABLE"
    assert error_code(RuntimeError("x")) == "INTERNAL"
    resp = error_response(pb, "bad", "INVALID_ARG")
    assert resp.err.code() == FakeTritonError.INVALID_ARG and resp.err.message() == "bad"


# ---------------------------------------------------------------------------------- deadlines, faults


def test_timeout_s_maps_and_is_checked():
    assert one({"text_input": s("hi"), "timeout_s": np.array([[2.5]], np.float32)}).request.timeout_s == 2.5
    assert one({"text_input": s("hi")}).request.timeout_s is None  # the engine's request_timeout_s
    for bad in (-1.0, float("inf")):
        with pytest.raises(InvalidRequestError, match="timeout_s"):
            one({"text_input": s("hi"), "timeout_s": np.array([[bad]], np.float32)})


def test_fault_parameter_only_with_fault_injection_enabled(monkeypatch):
    from specguide.engine import faults

    params = json.dumps({"specguide_fault": "nan_logits"})
    monkeypatch.delenv(faults.ENV, raising=False)
    assert one({"text_input": s("hi")}, parameters=params).request.fault is None
    monkeypatch.setenv(faults.ENV, "1")
    assert one({"text_input": s("hi")}, parameters=params).request.fault == "nan_logits"
    with pytest.raises(InvalidRequestError, match="unknown fault"):
        one({"text_input": s("hi")}, parameters=json.dumps({"specguide_fault": "meltdown"}))


# ---------------------------------------------------------------------------------- the three interfaces


def test_vllm_interface_defaults_are_vllms():
    p = vparse({"text_input": vtext("Hi")})[0]
    sp = p.request.params
    assert (sp.max_tokens, sp.temperature) == (16, 1.0) and not sp.greedy  # vLLM's SamplingParams()
    assert p.interface == "vllm" and p.exclude_input is False and p.echo_text == "Hi"  # non-streaming echoes
    assert not (p.return_finish_reason or p.return_logprobs or p.return_cumulative_logprob)
    p = vparse({"text_input": vtext("Hi"), "stream": np.array([True])})[0]
    assert p.stream and p.exclude_input
    # the request parameters are the sampling parameters when there is no tensor (as vLLM reads them)
    sp = vparse({"text_input": vtext("Hi")}, {"temperature": "0", "max_tokens": 5})[0].request.params
    assert sp.greedy and sp.max_tokens == 5
    # with the tensor, the tensor wins (the vLLM CI tests send both)
    sp = vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"max_tokens": 3}')},
                {"max_tokens": 9})[0].request.params
    assert sp.max_tokens == 3


def test_vllm_interface_errors_are_named_and_worded_like_vllm():
    with pytest.raises(InvalidRequestError) as e:
        vparse({"text_input": vtext("Hi"), "stream": np.array([True]), "exclude_input_in_output": np.array([False])})
    assert str(e.value) == "When streaming, `exclude_input_in_output` = False is not allowed."
    with pytest.raises(InvalidRequestError, match="unknown request parameter 'tempratur'"):
        vparse({"text_input": vtext("Hi")}, {"tempratur": 0})
    with pytest.raises(InvalidRequestError, match="input 'max_tokens' is not part of this model's interface"):
        vparse({"text_input": vtext("Hi"), "max_tokens": np.array([3], np.int32)})
    assert vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"lora_name": "sql"}')}
                  )[0].request.lora_name == "sql"  # the engine checks that it serves it
    with pytest.raises(InvalidRequestError, match="lora_name"):
        vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"lora_name": 3}')})
    with pytest.raises(InvalidRequestError, match="logprobs must be in"):
        vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"logprobs": 21}')})


def test_trtllm_word_lists_and_stop_words_are_token_sequences():
    words = np.array([[[5, 6, 7, -1], [2, 3, -1, -1]]], np.int32)  # "5 6" and "7"
    sp = one({"text_input": s("Hi"), "stop_words_list": words, "bad_words_list": words, "stop_words": s("ok")}).request.params
    assert sp.stop_token_seqs == [[111, 107], [5, 6], [7]] and sp.bad_words_ids == [[5, 6], [7]]
    assert sp.stop == []  # nothing is cut from the text: TensorRT-LLM keeps the stop word


def test_trtllm_aliases_and_unset_sampling_knobs():
    p = one({"input_ids": np.array([[1, 2, 3]], np.int32), "request_output_len": np.array([[5]], np.int32),
             "streaming": np.array([[True]]), "runtime_top_k": np.array([[0]], np.int32),
             "runtime_top_p": np.array([[0.0]], np.float32), "len_penalty": f32(1.0)})
    sp = p.request.params
    assert p.stream and sp.max_tokens == 5 and (sp.top_k, sp.top_p) == (0, 1.0)
    assert sp.greedy  # top_k / top_p <= 0 are unset (TensorRT-LLM's clients send 0 by default)
    sp = one({"text_input": s("Hi"), "top_p": f32(0.0), "temperature": f32(0.0)}).request.params
    assert sp.top_p == 1.0 and sp.greedy
    sp = one({"text_input": s("Hi"), "runtime_top_k": np.array([[5]], np.int32)}).request.params
    assert sp.top_k == 5 and sp.temperature == 1.0


def test_num_return_sequences_and_output_requests():
    rows = parse({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                  "num_return_sequences": np.array([[3], [1]], np.int32), "seed": np.array([[7], [9]], np.uint64),
                  "return_log_probs": np.array([[True], [False]]), "return_context_logits": np.array([[True], [False]]),
                  "return_generation_logits": np.array([[True], [False]])})
    assert [(r.batch_index, r.sequence_index) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [r.request.params.seed for r in rows] == [7, 8, 9, 9]  # each its own randomness
    assert len({id(r.request) for r in rows}) == 4 and len({id(r.request.params) for r in rows}) == 4
    sp = rows[0].request.params
    assert sp.return_log_probs and sp.return_context_logits and sp.return_generation_logits and sp.top_logprobs == 0
    assert not rows[3].request.params.return_log_probs


def test_stop_request_and_unknown_interface():
    assert is_stop_request({"stop": np.array([[True]])}) and not is_stop_request({"stop": np.array([[False]])})
    with pytest.raises(InvalidRequestError, match="unknown specguide_interface"):
        interface_of({INTERFACE_PARAMETER: "openai"})


def test_tensorrt_llm_embedding_bias_becomes_the_logit_bias():
    """The ensemble's words and weights (each token id of a word gets its weight, summed, as its
    preprocessing does) and tensorrt_llm's dense embedding_bias (its nonzero entries), clamped to
    +-100."""
    dense = np.zeros((1, 300), np.float32)
    dense[0, 7], dense[0, 200] = -1e9, 2.5
    sp = one({"text_input": s("Hi"), "embedding_bias_words": s("ab", "b"),
              "embedding_bias_weights": np.array([[1.5, 2.0]], np.float32), "embedding_bias": dense}).request.params
    assert sp.logit_bias == {ord("a"): 1.5, ord("b"): 3.5, 7: -100.0, 200: 2.5}
    with pytest.raises(InvalidRequestError, match="go in pairs") as e:
        parse({"text_input": s("Hi"), "embedding_bias_words": s("a", "b"), "embedding_bias_weights": f32(1.0)})
    assert error_code(e.value) == "INVALID_ARG"
    with pytest.raises(InvalidRequestError, match="finite"):
        parse({"text_input": s("Hi"), "embedding_bias": np.array([[np.nan]], np.float32)})
    too_many = np.ones((1, 301), np.float32)
    with pytest.raises(InvalidRequestError, match="at most 300"):
        parse({"text_input": s("Hi"), "embedding_bias": too_many})
