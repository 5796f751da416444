"""specguide.triton's request reading, parsing and responses against a tiny fake of
triton_python_backend_utils (no server needed)."""
from __future__ import annotations

import json
import os
import re
from enum import IntEnum
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specguide.request import InvalidRequestError, QueueFullError, RequestOutput, error_code
from specguide.triton import request_parser
from specguide.triton.interfaces import INTERFACE_PARAMETER, TRTLLM_INPUTS, TRTLLM_OUTPUTS
from specguide.triton.request_inputs import CLIENT_PARAMETERS, interface_of, is_stop_request, read_parameters, read_tensors
from specguide.triton.request_parser import parse_request
from specguide.triton.responses import Payload, SequenceStream, UnsupportedError, error_response, event_error_code, \
    merge_payloads, to_response

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- fakes


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeTritonError:
    Code = IntEnum("Code", "UNKNOWN INTERNAL NOT_FOUND INVALID_ARG UNAVAILABLE UNSUPPORTED ALREADY_EXISTS CANCELLED", start=0)
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = Code  # .name, as Triton's

    def __init__(self, message, code=Code.INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors}
        self.err = error

    def has_error(self):
        return self.err is not None

    def error(self):
        return self.err


class FakeRequest:
    def __init__(self, inputs, parameters="{}"):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self._parameters = parameters

    def parameters(self):
        return self._parameters


pb = SimpleNamespace(
    Tensor=FakeTensor,
    TritonError=FakeTritonError,
    InferenceResponse=FakeResponse,
    get_input_tensor_by_name=lambda req, name: req.inputs.get(name),
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
)


class FakeTokenizer:
    """Bytes as tokens (id = byte value); the interface of specguide.tokenizer.Tokenizer."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


TOK = FakeTokenizer()


def s(*vals):  # one row of strings, batch 1: shape [1, n]
    return np.array([[v.encode() if isinstance(v, str) else v for v in vals]], dtype=np.object_)


def vllm(**sp):  # a vLLM sampling_parameters tensor
    return s(json.dumps(sp))


def parse(inputs, parameters="{}", **kw):
    req = FakeRequest(inputs, parameters)
    kw.setdefault("tokenizer", TOK)
    kw.setdefault("max_tokens_limit", 2048)
    return parse_request(read_tensors(pb, req), read_parameters(req), **kw)


def one(inputs, **kw):
    rows = parse(inputs, **kw)
    assert len(rows) == 1
    return rows[0]


# ---------------------------------------------------------------------------------- inputs


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


def f32(v):
    return np.array([[v]], np.float32)


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


# ---------------------------------------------------------------------------------- outputs


def out(text, ids, finished=False, reason=None, n_in=3, n_out=0, error=None):
    return RequestOutput(seq_id=1, text=text, token_ids=ids, finished=finished, finish_reason=reason,
                         error=error, num_input_tokens=n_in, num_output_tokens=n_out)


def texts(payload):
    return payload.outputs["text_output"].reshape(-1)[0].decode()


def test_streaming_sends_one_delta_per_event_and_final_last():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "return_num_output_tokens": np.array([[True]]),
             "return_num_input_tokens": np.array([[True]])})
    st = SequenceStream(p)
    a = st.on_output(out("He", [1, 2], n_out=2))
    assert st.on_output(out("", [], n_out=2)) is None  # nothing new: nothing sent
    b = st.on_output(out("llo", [3], finished=True, reason="length", n_out=3))
    assert [texts(a), texts(b)] == ["He", "llo"]
    assert not a.finished and b.finished
    assert a.outputs["text_output"].shape == (1,)  # 1-D, as the TensorRT-LLM ensemble sends it
    assert a.outputs["output_ids"].tolist() == [[[1, 2]]] and a.outputs["output_ids"].dtype == np.int32
    assert a.outputs["sequence_length"].tolist() == [[2]] and b.outputs["sequence_index"].tolist() == [[0]]
    assert a.outputs["finish_reason"].tolist() == [[b""]] and b.outputs["finish_reason"].tolist() == [[b"length"]]
    assert b.outputs["num_output_tokens"].tolist() == [[1]] and b.outputs["num_output_tokens"].dtype == np.uint32
    assert b.outputs["num_input_tokens"].tolist() == [[3]]
    assert "total_draft_tokens" not in b.outputs


def test_num_cached_tokens_comes_with_num_input_tokens():
    o = out("a", [1], finished=True, reason="length")
    o.num_cached_tokens = 256
    asked = one({"text_input": s("Hi"), "return_num_input_tokens": np.array([[True]])})
    got = SequenceStream(asked).on_output(o).outputs
    assert got["num_cached_tokens"].tolist() == [[256]] and got["num_cached_tokens"].dtype == np.uint32
    assert "num_cached_tokens" not in SequenceStream(one({"text_input": s("Hi")})).on_output(o).outputs
    v = vparse({"text_input": vtext("Hi"), "return_num_input_tokens": np.array([True])})[0]
    assert "num_cached_tokens" not in SequenceStream(v).on_output(o).outputs  # vLLM's outputs exactly


def test_non_streaming_accumulates_into_exactly_one_payload_with_echo():
    p = one({"text_input": s("Hi"), "return_num_output_tokens": np.array([[True]])})
    st = SequenceStream(p)
    assert st.on_output(out(" there", [1, 2], n_out=2)) is None
    final = st.on_output(out("!", [3], finished=True, reason="stop", n_out=3))
    assert texts(final) == "Hi there!"
    assert final.outputs["output_ids"].tolist() == [[list(b"Hi") + [1, 2, 3]]]
    assert final.outputs["sequence_length"].tolist() == [[5]]
    assert final.outputs["num_output_tokens"].tolist() == [[3]]
    assert final.finished


def test_a_stream_never_repeats_the_prompt_even_with_exclude_false():
    # TensorRT-LLM never streams the prompt (its client's `-S --check-outputs` expects only new text)
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "exclude_input_in_output": np.array([[False]])})
    st = SequenceStream(p)
    assert texts(st.on_output(out("a", [1]))) == "a"
    assert texts(st.on_output(out("b", [2], finished=True, reason="stop"))) == "b"


def test_error_and_cancel_events_become_error_payloads():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]])})
    e = SequenceStream(p).on_output(out("", [], finished=True, reason="error", error="boom"))
    assert e.error == "boom" and e.error_code == "INTERNAL" and e.finished
    c = SequenceStream(p).on_output(out("", [], finished=True, reason="cancelled"))
    assert c.error_code == "CANCELLED" and c.finished
    resp = to_response(pb, c)
    assert resp.err.code() == FakeTritonError.CANCELLED


@pytest.mark.parametrize("code,expected", [
    (None, "INTERNAL"), ("INTERNAL", "INTERNAL"), ("INVALID_ARG", "INVALID_ARG"), ("invalid_arg", "INVALID_ARG"),
    ("UNAVAILABLE", "UNAVAILABLE"), ("BOGUS", "INTERNAL"),
])
def test_error_event_code_comes_from_the_engine_event(code, expected):
    p = one({"text_input": s("Hi"), "stream": np.array([[True]])})
    o = out("", [], finished=True, reason="error", error="grammar compile failed: bad regex")
    o.error_code = code
    e = SequenceStream(p).on_output(o)
    assert e.error == "grammar compile failed: bad regex" and e.error_code == expected and e.finished
    resp = to_response(pb, e)
    assert resp.err.code() == getattr(FakeTritonError, expected) and resp.err.message() == e.error


def test_perf_metrics_outputs_when_asked():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "return_perf_metrics": np.array([[True]])})
    o = out("a", [1], finished=True, reason="stop")
    o.total_draft_tokens, o.total_accepted_draft_tokens = 6, 3
    pl = SequenceStream(p).on_output(o)
    assert pl.outputs["total_draft_tokens"].tolist() == [[6]]
    assert pl.outputs["acceptance_rate"].tolist() == [[0.5]]
    resp = to_response(pb, pl)
    assert set(resp.tensors) == {"text_output", "output_ids", "sequence_length", "finish_reason", "batch_index",
                                 "sequence_index", "total_draft_tokens", "total_accepted_draft_tokens",
                                 "acceptance_rate", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                                 "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
                                 "first_token_time_ns", "last_token_time_ns"}


def test_batch_index_output():
    rows = parse({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "stream": np.array([[True], [True]])})
    pl = SequenceStream(rows[1]).on_output(out("x", [1]))
    assert pl.outputs["batch_index"].tolist() == [[1]]


# ---------------------------------------------------------------------------------- config.pbtxt


def _pbtxt_entries(section):
    text = (ROOT / "model_repository" / "specguide" / "config.pbtxt").read_text()
    body = re.search(section + r"\s*\[(.*?)\n\]", text, re.S).group(1)
    entries = {}
    for block in re.findall(r"\{(.*?)\}", body, re.S):
        name = re.search(r'name:\s*"([^"]+)"', block).group(1)
        dtype = re.search(r"data_type:\s*(\w+)", block).group(1)
        dims = tuple(int(d) for d in re.search(r"dims:\s*\[([^\]]*)\]", block).group(1).split(","))
        optional = re.search(r"optional:\s*true", block) is not None
        entries[name] = (dtype, dims, optional)
    return text, entries


def test_config_pbtxt_declares_exactly_the_io_specs():
    text, inputs = _pbtxt_entries("input")
    _, outputs = _pbtxt_entries("output")
    assert {k: v[:2] for k, v in inputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in TRTLLM_INPUTS}
    assert all(opt for _, _, opt in inputs.values()), "every input is optional"
    assert {k: v[:2] for k, v in outputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in TRTLLM_OUTPUTS}
    assert re.search(r"decoupled:\s*true", text)
    assert int(re.search(r"max_batch_size:\s*(\d+)", text).group(1)) > 0
    assert 'backend: "python"' in text


def test_config_pbtxt_parameters_build_an_engine_config():
    from specguide.config import EngineConfig

    text = (ROOT / "model_repository" / "specguide" / "config.pbtxt").read_text()
    params = {k: {"string_value": v} for k, v in
              re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}', text)}
    assert params, "config.pbtxt has engine parameters"
    cfg = EngineConfig.from_parameters(params)
    known = {f for f in EngineConfig.__dataclass_fields__}
    assert set(params) <= known, f"unknown parameters: {set(params) - known}"
    assert cfg.max_slots >= 1 or cfg.device == "auto"  # "auto": the engine sizes it (8 on CPU)


def test_the_interfaces_doc_documents_every_input_and_output():
    doc = (ROOT / "docs" / "interfaces.md").read_text()
    for sp in TRTLLM_INPUTS:
        assert f"`{sp.name}`" in doc, sp.name
    for sp in TRTLLM_OUTPUTS:
        assert f"`{sp.name}`" in doc, sp.name


def test_the_configuration_doc_lists_every_engine_setting():
    from specguide.config import EngineConfig

    doc = (ROOT / "docs" / "configuration.md").read_text()
    settings = doc[doc.index("## All settings"):]
    missing = [f for f in EngineConfig.__dataclass_fields__ if f"`{f}`" not in settings]
    assert not missing, f"docs/configuration.md's engine settings miss {missing}"


def test_client_sends_the_declared_dtypes():
    from client.common import INPUT_TYPES

    triton = {"TYPE_STRING": "BYTES"}
    assert set(INPUT_TYPES) == {sp.name for sp in TRTLLM_INPUTS if not sp.vllm_only}
    for sp in TRTLLM_INPUTS:
        if sp.vllm_only:
            continue
        assert INPUT_TYPES[sp.name][1] == triton.get(sp.dtype, sp.dtype[5:]), sp.name


# ---------------------------------------------------------------------------------- adapter with fakes


class FakeMetric:
    def __init__(self):
        self.value = 0.0
        self.observed = []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observed.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    families = {}

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, {}
        FakeMetricFamily.families[name] = self

    def Metric(self, labels, buckets=None):
        m = FakeMetric()
        self.metrics[tuple(sorted(labels.items()))] = m
        return m


class FakeSender:
    def __init__(self):
        self.sent = []  # (response, flags)
        self.cancelled = False
        self.lock = __import__("threading").Lock()

    def send(self, response=None, flags=0):
        with self.lock:
            self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled

    def finished(self):
        return any(f == 1 for _, f in self.sent)


class FakeTritonRequest(FakeRequest):
    def __init__(self, inputs, parameters="{}"):
        super().__init__(inputs, parameters)
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return "rid"


BAD_REGEX = "(ab"


class FakeEngine:
    """Emits `max_tokens` one-token events per request from its own thread, one every few ms
    (in place of engine_process.EngineProcess)."""

    instances = []
    pid, drafter, warmup_s, head_drafter, frozen_objects = 0, "ngram", 0.0, None, 0
    info = SimpleNamespace(model_dir="")  # no config.json: the stub checks token ids against no vocabulary

    def __init__(self, config, log=None, server_pid=None):
        import threading

        self.config, self.tokenizer, self.server_pid = config, TOK, server_pid
        self.submitted, self.cancelled, self.shutdown_args = [], set(), None
        self.fail_with = None
        self._next = 0
        self._lock = threading.Lock()
        FakeEngine.instances.append(self)

    def submit(self, request, callback):
        import threading

        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            self._next += 1
            seq_id = self._next
        self.submitted.append(request)
        threading.Thread(target=self._run, args=(seq_id, request, callback), daemon=True).start()
        return seq_id

    def _run(self, seq_id, request, callback):
        import time

        if request.guided is not None and request.guided.guide == BAD_REGEX:  # found at compile, after submit
            callback(RequestOutput(seq_id=seq_id, finished=True, finish_reason="error",
                                   error="invalid regex guide: (ab", error_code="INVALID_ARG"))
            return
        n = request.params.max_tokens
        for i in range(1, n + 1):
            time.sleep(0.005)
            if seq_id in self.cancelled:
                callback(RequestOutput(seq_id=seq_id, finished=True, finish_reason="cancelled", num_output_tokens=i - 1))
                return
            callback(RequestOutput(seq_id=seq_id, text=f"t{i}", token_ids=[i], finished=i == n,
                                   finish_reason="length" if i == n else None, num_input_tokens=2, num_output_tokens=i))

    def cancel(self, seq_id):
        self.cancelled.add(seq_id)

    def stats(self):
        return {"active_slots": 0, "queue_depth": 0, "alive": int(self.is_alive()), "restarts": 0,
                "max_slots": self.config.max_slots, "steps": 7}

    def is_alive(self):
        return True

    def down_reason(self):
        return None

    def shutdown(self, drain=True, timeout=None):
        self.shutdown_args = (drain, timeout)


@pytest.fixture
def model(monkeypatch):
    import importlib
    import sys

    fake_pb = SimpleNamespace(
        **vars(pb),
        Logger=SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None),
        TritonModelException=RuntimeError,
        MetricFamily=FakeMetricFamily,
        using_decoupled_model_transaction_policy=lambda cfg: cfg.get("model_transaction_policy", {}).get("decoupled", False),
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb)
    monkeypatch.delitem(sys.modules, "specguide.triton.adapter", raising=False)
    import specguide.process.engine_process

    monkeypatch.setattr(specguide.process.engine_process, "EngineProcess", FakeEngine)
    adapter = importlib.import_module("specguide.triton.adapter")
    m = adapter.TritonPythonModel()
    m.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                              "parameters": {"max_slots": {"string_value": "2"}, "warmup": {"string_value": "false"}}}),
                  "model_name": "specguide", "model_version": "1", "model_instance_name": "specguide_0_0",
                  "model_instance_kind": "MODEL", "model_instance_device_id": "0"})
    assert m.engine.server_pid == os.getppid()  # the server the engine process watches: the stub's parent
    yield m
    m.finalize()
    sys.modules.pop("specguide.triton.adapter", None)


def wait_for(cond, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_adapter_streams_deltas_and_one_final(model):
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[3]], np.int32), "stream": np.array([[True]])})
    assert model.execute([req]) is None
    wait_for(req.sender.finished)
    assert [f for _, f in req.sender.sent] == [0, 0, 1]
    assert [r.tensors["text_output"][0] for r, _ in req.sender.sent] == [b"t1", b"t2", b"t3"]
    assert model.engine.config.max_slots == 2  # config.pbtxt parameters reach the engine
    fam = FakeMetricFamily.families
    labels = (("model", "specguide"), ("model_instance", "specguide_0_0"), ("version", "1"))  # sorted
    wait_for(lambda: fam["specguide_generation_tokens_total"].metrics[labels].value == 3)
    assert len(fam["specguide_time_to_first_token_seconds"].metrics[labels].observed) == 1


def _peer(name, **labels):
    """The one series of a vLLM / TensorRT-LLM family with these labels (adapter fixture's fakes)."""
    got = [m for k, m in FakeMetricFamily.families[name].metrics.items() if set(labels.items()) <= set(k)]
    assert len(got) == 1, (name, labels, list(FakeMetricFamily.families[name].metrics))
    return got[0]


def test_adapter_labels_the_peer_metrics_with_the_model_the_traffic_came_through(model):
    direct = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[3]], np.int32),
                                "stream": np.array([[True]]), "num_return_sequences": np.array([[2]], np.int32)})
    proxied = FakeTritonRequest({"text_input": s("Hi")},
                                json.dumps({INTERFACE_PARAMETER: "vllm", CLIENT_PARAMETERS: '{"max_tokens": 4}',
                                            "specguide_served_model": "specguide_vllm",
                                            "specguide_served_version": "1"}))
    model.execute([direct, proxied])
    wait_for(direct.sender.finished)
    wait_for(proxied.sender.finished)
    assert proxied.sender.sent[0][0].err is None
    trt, vllm = {"model": "specguide", "version": "1"}, {"model": "specguide_vllm", "version": "1"}
    wait_for(lambda: len(_peer("vllm:e2e_request_latency_seconds", **vllm).observed) == 1)
    wait_for(lambda: len(_peer("vllm:e2e_request_latency_seconds", **trt).observed) == 2)
    # two sequences of 3 tokens (one prompt, n=2) through specguide; one of 4 through specguide_vllm
    assert _peer("vllm:generation_tokens_total", **trt).value == 6
    assert _peer("vllm:generation_tokens_total", **vllm).value == 4
    assert _peer("vllm:prompt_tokens_total", **trt).value == 4 and _peer("vllm:prompt_tokens_total", **vllm).value == 2
    assert len(_peer("vllm:time_to_first_token_seconds", **trt).observed) == 2
    assert len(_peer("vllm:time_per_output_token_seconds", **trt).observed) == 4  # one per step after the first
    assert _peer("vllm:request_generation_tokens", **trt).observed == [3, 3]
    assert _peer("vllm:request_params_n", **trt).observed == [2] and _peer("vllm:request_params_n", **vllm).observed == [1]
    assert _peer("nv_llm_output_token_len", **vllm).observed == [4]
    assert _peer("nv_llm_input_token_len", **trt).observed == [2, 2]
    assert _peer("vllm:generation_tokens_total", model="specguide_unary").value == 0
    # the engine's state: gauges labelled with the engine model, set from its stats
    wait_for(lambda: _peer("nv_trt_llm_general_metrics", general_type="iteration_counter").value == 7)
    assert _peer("nv_trt_llm_request_metrics", request_type="max", model="specguide").value == 2


def test_adapter_non_streaming_sends_exactly_one_final_response(model):
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[4]], np.int32)})
    model.execute([req])
    wait_for(req.sender.finished)
    assert len(req.sender.sent) == 1 and req.sender.sent[0][1] == 1
    assert req.sender.sent[0][0].tensors["text_output"][0] == b"Hit1t2t3t4"


def test_adapter_bad_request_gets_an_error_and_touches_nothing(model):
    bad = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[0]], np.int32)})
    good = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[2]], np.int32), "stream": np.array([[True]])})
    model.execute([bad, good])
    wait_for(good.sender.finished)
    assert len(bad.sender.sent) == 1
    resp, flags = bad.sender.sent[0]
    assert flags == 1 and resp.err.code() == FakeTritonError.INVALID_ARG and "max_tokens" in resp.err.message()
    assert len(model.engine.submitted) == 1
    assert [f for _, f in good.sender.sent] == [0, 1]


def test_adapter_errors_travel_as_an_output_when_the_client_asks(model):
    """`specguide_error_output` (the OpenAI server): every error is the output specguide_error [code, message]."""
    asked = json.dumps({"specguide_error_output": True})
    early = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[0]], np.int32)}, asked)
    late = FakeTritonRequest({"text_input": s("Hi"), "guided_decoding_guide_type": s("regex"),
                              "guided_decoding_guide": s(BAD_REGEX), "stream": np.array([[True]])}, asked)
    model.execute([early, late])
    wait_for(early.sender.finished)
    wait_for(late.sender.finished)
    for req, text in ((early, "max_tokens"), (late, "(ab")):
        (resp, flags), = req.sender.sent
        assert flags == 1 and resp.err is None
        code, message = resp.tensors["specguide_error"].reshape(-1)
        assert code and text in message.decode()


def test_adapter_guide_error_after_submit_is_invalid_arg_and_others_run(model):
    bad = FakeTritonRequest({"text_input": s("Hi"), "guided_decoding_guide_type": s("regex"),
                             "guided_decoding_guide": s(BAD_REGEX), "stream": np.array([[True]])})
    good = FakeTritonRequest({"text_input": s("Hi"), "guided_decoding_guide_type": s("regex"),
                              "guided_decoding_guide": s("t[0-9]+"), "max_tokens": np.array([[2]], np.int32)})
    model.execute([bad, good])
    wait_for(bad.sender.finished)
    wait_for(good.sender.finished)
    (resp, flags), = bad.sender.sent
    assert flags == 1 and resp.err.code() == FakeTritonError.INVALID_ARG and "(ab" in resp.err.message()
    (resp, flags), = good.sender.sent
    assert flags == 1 and resp.err is None and resp.tensors["finish_reason"][0, 0] == b"length"
    fam = FakeMetricFamily.families["specguide_requests_total"].metrics
    wait_for(lambda: fam[(("finish_reason", "error"), ("model", "specguide"), ("model_instance", "specguide_0_0"), ("version", "1"))].value == 1)


def test_adapter_engine_refusal_becomes_unavailable(model):
    model.engine.fail_with = QueueFullError("the waiting queue is full")
    req = FakeTritonRequest({"text_input": s("Hi")})
    model.execute([req])
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.err.code() == FakeTritonError.UNAVAILABLE


def test_adapter_cancellation_cancels_the_engine_sequence(model):
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[500]], np.int32), "stream": np.array([[True]])})
    model.execute([req])
    wait_for(lambda: len(req.sender.sent) >= 2)
    req.sender.cancelled = True
    wait_for(req.sender.finished)
    assert model.engine.cancelled == {1}
    resp, flags = req.sender.sent[-1]
    assert flags == 1 and resp.err.code() == FakeTritonError.CANCELLED
    assert len(req.sender.sent) < 100


def test_adapter_batch_rows_share_one_final(model):
    req = FakeTritonRequest({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                             "max_tokens": np.array([[2], [3]], np.int32), "stream": np.array([[True], [True]])})
    model.execute([req])
    wait_for(req.sender.finished)
    flags = [f for _, f in req.sender.sent]
    assert flags.count(1) == 1 and flags[-1] == 1 and len(flags) == 5
    rows = sorted(int(r.tensors["batch_index"][0, 0]) for r, _ in req.sender.sent)
    assert rows == [0, 0, 1, 1, 1]


def test_adapter_finalize_drains_the_engine(model):
    engine = model.engine
    model.finalize()
    assert engine.shutdown_args[0] is True
    assert not model._thread.is_alive()


# ---------------------------------------------------------------------------------- reliability


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


def test_adapter_dead_engine_refuses_at_once_with_unavailable_and_is_not_ready(model):
    assert model.is_ready()
    model.engine.is_alive = lambda: False
    model.engine.down_reason = lambda: "the engine stopped (killed by SIGKILL); a new engine is starting"
    assert not model.is_ready()
    req = FakeTritonRequest({"text_input": s("Hi")})
    model.execute([req])
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.err.code() == FakeTritonError.UNAVAILABLE and "engine stopped" in resp.err.message()
    assert model.engine.submitted == []
    alive = FakeMetricFamily.families["specguide_engine_alive"].metrics[(("model", "specguide"), ("model_instance", "specguide_0_0"), ("version", "1"))]
    wait_for(lambda: alive.value == 0.0)


def test_adapter_engine_death_event_is_unavailable_and_cancels_count_by_stage(model):
    out = RequestOutput(seq_id=1, finished=True, finish_reason="error", error="the engine stopped", error_code="UNAVAILABLE")
    assert event_error_code(out) == "UNAVAILABLE"
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[500]], np.int32), "stream": np.array([[True]])})
    model.execute([req])
    wait_for(lambda: len(req.sender.sent) >= 1)
    seq = next(iter(model._live))
    model._deliver(seq, RequestOutput(seq_id=seq.seq_id, finished=True, finish_reason="cancelled", stage="decode"), 0.0)
    stages = FakeMetricFamily.families["specguide_cancellations_total"].metrics
    assert stages[(("model", "specguide"), ("model_instance", "specguide_0_0"), ("stage", "decode"), ("version", "1"))].value == 1
    assert req.sender.sent[-1][1] == 1 and req.sender.sent[-1][0].err.code() == FakeTritonError.CANCELLED


def test_adapter_finalize_uses_the_drain_timeout(model):
    engine = model.engine
    model.finalize()
    assert engine.shutdown_args == (True, model.config.drain_timeout_s)


# ---------------------------------------------------------------------------------- the three interfaces


def vparse(inputs, parameters=None, **kw):
    """A request as specguide_vllm passes it on: [1]-shaped inputs given a batch dim, interface named."""
    params = {INTERFACE_PARAMETER: "vllm", CLIENT_PARAMETERS: json.dumps(parameters or {})}
    return parse({k: np.asarray(v)[None] for k, v in inputs.items()}, json.dumps(params), **kw)


def vtext(text):
    return np.array([text.encode()], dtype=np.object_)


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
    with pytest.raises(UnsupportedError, match="lora_name"):
        vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"lora_name": "x"}')})
    with pytest.raises(InvalidRequestError, match="logprobs must be in"):
        vparse({"text_input": vtext("Hi"), "sampling_parameters": vtext('{"logprobs": 21}')})


def test_vllm_outputs_are_1d_and_only_when_asked():
    p = vparse({"text_input": vtext("Hi"), "stream": np.array([True]), "return_finish_reason": np.array([True]),
                "return_cumulative_logprob": np.array([True]), "return_logprobs": np.array([True]),
                "return_num_input_tokens": np.array([True]), "return_num_output_tokens": np.array([True]),
                "sampling_parameters": vtext('{"logprobs": 1, "temperature": 0}')})[0]
    assert p.request.params.return_log_probs and p.request.params.top_logprobs == 1
    st = SequenceStream(p, TOK)
    o = out("ab", [97, 98], n_out=2)
    o.logprobs, o.top_logprobs = [-0.5, -0.25], [[(97, -0.5)], [(120, -0.1)]]
    a = st.on_output(o).outputs
    assert {k: v.shape for k, v in a.items()} == {k: (1,) for k in (
        "text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")}
    assert a["finish_reason"][0] == b"None" and a["cumulative_logprob"][0] == pytest.approx(-0.75)
    doc = json.loads(a["logprobs"][0])
    assert doc[0] == {"97": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    assert doc[1]["98"]["rank"] == 2 and doc[1]["120"] == {"logprob": -0.1, "rank": 1, "decoded_token": "x"}
    o = out("c", [99], finished=True, reason="timeout", n_out=3)
    o.logprobs, o.top_logprobs = [-1.0], [[(99, -1.0)]]
    b = st.on_output(o).outputs
    assert b["finish_reason"][0] == b"abort" and b["cumulative_logprob"][0] == pytest.approx(-1.75)
    assert b["num_output_tokens"].tolist() == [1]
    # without `logprobs` in sampling_parameters, the output is JSON null (as vLLM)
    p = vparse({"text_input": vtext("Hi"), "return_logprobs": np.array([True])})[0]
    o = out("a", [97], finished=True, reason="length")
    o.logprobs = [-0.5]
    assert json.loads(SequenceStream(p, TOK).on_output(o).outputs["logprobs"][0]) is None
    e = SequenceStream(p).on_output(out("", [], finished=True, reason="error", error="boom"))
    assert e.error == "Error generating stream: boom"
    c = SequenceStream(p).on_output(out("", [], finished=True, reason="cancelled"))
    assert c.error == "Request was cancelled" and c.error_code == "CANCELLED"


def test_trtllm_return_logprobs_sends_vllms_json_of_the_generated_tokens():
    """`return_logprobs` on `specguide` (the OpenAI server's logprobs): the generated tokens' vLLM JSON, top N from
    sampling_parameters' `logprobs` (default 0), never the echoed prompt."""
    p = one({"text_input": s("Hi"), "return_logprobs": np.array([[True]]),
             "sampling_parameters": s('{"logprobs": 1, "temperature": 0}')})
    assert p.interface == "trtllm" and p.return_logprobs and p.request.params.top_logprobs == 1
    o = out("ab", [97, 98], finished=True, reason="stop", n_out=2)
    o.logprobs, o.top_logprobs = [-0.5, -0.25], [[(97, -0.5)], [(120, -0.1)]]
    doc = json.loads(SequenceStream(p, TOK).on_output(o).outputs["logprobs"][0])
    assert doc[0] == {"97": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    assert doc[1]["98"]["rank"] == 2 and doc[1]["120"]["rank"] == 1
    p = one({"text_input": s("Hi"), "return_logprobs": np.array([[True]]), "stream": np.array([[True]])})
    assert p.request.params.return_log_probs and p.request.params.top_logprobs == 0
    o = out("a", [97], n_out=1)
    o.logprobs = [-0.5]
    assert json.loads(SequenceStream(p, TOK).on_output(o).outputs["logprobs"][0]) == [
        {"97": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}]


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


def test_trtllm_log_probs_and_logits_shapes():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "return_log_probs": np.array([[True]]),
             "return_generation_logits": np.array([[True]]), "return_context_logits": np.array([[True]])})
    st = SequenceStream(p)
    o = out("ab", [1, 2])
    o.logprobs, o.generation_logits = [-0.5, -0.25], np.ones((2, 7), np.float32)
    o.context_logits = np.zeros((3, 7), np.float32)
    a = st.on_output(o).outputs
    assert a["output_log_probs"].shape == (1, 1, 2) and a["cum_log_probs"].tolist() == [[-0.75]]
    assert a["generation_logits"].shape == (1, 1, 2, 7) and a["context_logits"].shape == (1, 3, 7)
    o = out("c", [3], finished=True, reason="length")
    o.logprobs, o.generation_logits = [-1.0], np.ones((1, 7), np.float32)
    b = st.on_output(o).outputs
    assert b["output_log_probs"].tolist() == [[[-1.0]]] and b["cum_log_probs"].tolist() == [[-1.75]]
    assert "context_logits" not in b  # sent once


def test_unary_interface_refuses_streaming_and_merges_rows():
    params = json.dumps({INTERFACE_PARAMETER: "unary"})
    with pytest.raises(InvalidRequestError, match="stream=true needs a decoupled model"):
        parse({"text_input": s("Hi"), "stream": np.array([[True]])}, params)
    rows = parse({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "exclude_input_in_output":
                  np.array([[True], [True]])}, params)
    pays = [SequenceStream(r).on_output(out(t, ids, finished=True, reason="length"))
            for r, (t, ids) in zip(rows, [("xy", [1, 2]), ("z", [3])])]
    m = merge_payloads(pays)
    assert m.outputs["text_output"].tolist() == [b"xy", b"z"]
    assert m.outputs["output_ids"].tolist() == [[[1, 2]], [[3, 0]]] and m.outputs["sequence_length"].tolist() == [[2], [1]]
    assert m.outputs["batch_index"].tolist() == [[0], [1]]
    err = Payload(error="boom", error_code="INVALID_ARG", finished=True)
    assert merge_payloads([pays[0], err]).error == "boom"


def test_stop_request_and_unknown_interface():
    assert is_stop_request({"stop": np.array([[True]])}) and not is_stop_request({"stop": np.array([[False]])})
    with pytest.raises(InvalidRequestError, match="unknown specguide_interface"):
        interface_of({INTERFACE_PARAMETER: "openai"})


def test_adapter_stop_request_cancels_the_request_with_that_id(model):
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[500]], np.int32), "stream": np.array([[True]])})
    model.execute([req])
    wait_for(lambda: len(req.sender.sent) >= 1)
    stop = FakeTritonRequest({"stop": np.array([[True]])})  # same request id ("rid")
    model.execute([stop])
    assert stop.sender.sent == [(None, 1)]  # answered at once, with FINAL only
    wait_for(req.sender.finished)
    assert model.engine.cancelled and req.sender.sent[-1][0].err.code() == FakeTritonError.CANCELLED


def test_adapter_unary_request_gets_one_response_for_all_rows(model):
    req = FakeTritonRequest({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                             "max_tokens": np.array([[2], [3]], np.int32), "exclude_input_in_output": np.array([[True], [True]]),
                             "num_return_sequences": np.array([[2], [1]], np.int32)},
                            parameters=json.dumps({INTERFACE_PARAMETER: "unary"}))
    model.execute([req])
    wait_for(req.sender.finished)
    assert len(req.sender.sent) == 1 and req.sender.sent[0][1] == 1
    t = req.sender.sent[0][0].tensors
    assert t["text_output"].tolist() == [b"t1t2", b"t1t2", b"t1t2t3"]
    assert t["sequence_index"].reshape(-1).tolist() == [0, 1, 0]


def test_adapter_unexpected_errors_never_show_python_exception_text(model, monkeypatch):
    """Issue 19: an unexpected exception while reading a request is INTERNAL with our own words."""
    def boom(*a, **k):
        raise RecursionError("maximum recursion depth exceeded while decoding a JSON object")

    monkeypatch.setattr(request_parser, "parse_request", boom)
    req = FakeTritonRequest({"text_input": s("Hi")})
    model.execute([req])
    (resp, flags), = req.sender.sent
    msg = resp.err.message()
    assert flags == 1 and resp.err.code() == FakeTritonError.INTERNAL
    assert "could not read the request" in msg and "recursion" not in msg


def test_adapter_refuses_a_huge_prompt_by_bytes_before_tokenizing(model, monkeypatch):
    calls = []
    monkeypatch.setattr(TOK, "encode", lambda text: calls.append(len(text)) or list(text.encode()), raising=False)
    req = FakeTritonRequest({"text_input": s("x" * 200_000)})
    model.execute([req])
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.err.code() == FakeTritonError.INVALID_ARG
    assert "text_input has 200000 bytes" in resp.err.message() and calls == []


def test_prompt_logprobs_go_out_once_on_the_first_payload_after_the_prefill():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "sampling_parameters": vllm(prompt_logprobs=1)})
    assert p.request.params.prompt_logprobs == 1
    st = SequenceStream(p)
    o = out("a", [1])
    o.prompt_logprobs = [(3, None, []), (5, -0.5, [(7, -0.25)])]
    first = st.on_output(o).outputs
    doc = json.loads(first["prompt_logprobs"].reshape(-1)[0])
    assert doc == [{"3": {"logprob": None, "rank": None, "decoded_token": ""}},
                   {"5": {"logprob": -0.5, "rank": 2, "decoded_token": ""},
                          "7": {"logprob": -0.25, "rank": 1, "decoded_token": ""}}]
    assert "prompt_logprobs" not in st.on_output(out("b", [2], finished=True, reason="stop")).outputs
    # specguide_vllm has vLLM's outputs exactly, none for them: only vLLM's neutral 0 (or none) is taken
    v = vparse({"text_input": vtext("Hi"), "sampling_parameters": np.array([json.dumps({"prompt_logprobs": 0}).encode()],
                                                                            np.object_)})[0]
    assert v.request.params.prompt_logprobs is None
    with pytest.raises(UnsupportedError, match="prompt_logprobs"):
        vparse({"text_input": vtext("Hi"), "sampling_parameters": np.array([json.dumps({"prompt_logprobs": 2}).encode()],
                                                                            np.object_)})


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
