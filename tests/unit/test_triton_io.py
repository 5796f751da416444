"""specguide.triton.io against a tiny fake of triton_python_backend_utils (no server needed)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specguide.request import InvalidRequestError, QueueFullError, RequestOutput
from specguide.triton import io

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
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=1):
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
    return io.parse_request(io.read_tensors(pb, req), io.read_parameters(req), **kw)


def one(inputs, **kw):
    rows = parse(inputs, **kw)
    assert len(rows) == 1
    return rows[0]


# ---------------------------------------------------------------------------------- inputs


def test_minimal_text_request_gets_trtllm_defaults():
    p = one({"text_input": s("Hello")}, default_max_tokens=64)
    r = p.request
    assert r.prompt == "Hello" and r.prompt_ids is None
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
    assert sp.stop == ["\n\n", "END"]  # empty strings (as curl examples send) are skipped
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
    p = one({"text_input": s("Hi")}, parameters=json.dumps({"max_tokens": 5, "temperature": 0.0, "unrelated": "x"}))
    assert p.request.params.max_tokens == 5


def test_vllm_sampling_parameters_with_string_values_and_vllm_defaults():
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"min_tokens": "2", "top_k": -1}))}).request.params
    assert sp.max_tokens == 16 and sp.temperature == 1.0 and sp.top_k == 0 and sp.min_tokens == 2
    sp = one({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({
        "max_tokens": "8", "temperature": 0, "stop": "x", "stop_token_ids": [1, 2], "ignore_eos": True,
        "seed": 3, "n": 1, "frequency_penalty": 0.0, "lora_name": None, "some_future_key": 1}))}).request.params
    assert (sp.max_tokens, sp.temperature, sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.seed) == (8, 0.0, ["x"], [1, 2], True, 3)


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
    ({"repetition_penalty": f32(0.0)}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": f32(-1.0)}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": f32(np.inf)}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": f32(np.nan)}, "repetition_penalty must be a number"),
    ({"presence_penalty": f32(2.5)}, "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": f32(-3.0)}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": f32(-2.01)}, "frequency_penalty must be in [-2, 2]"),
    ({"frequency_penalty": f32(np.inf)}, "frequency_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(repetition_penalty=0)}, "repetition_penalty must be a finite number > 0"),
    ({"sampling_parameters": vllm(presence_penalty="2.5")}, "presence_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(frequency_penalty=-7)}, "frequency_penalty must be in [-2, 2]"),
    ({"sampling_parameters": vllm(repetition_penalty="lots")}, "repetition_penalty must be a number"),
    ({"sampling_parameters": vllm(presence_penalty=True)}, "presence_penalty must be a number"),
    ({"sampling_parameters": vllm(repetition_penalty=1.5), "repetition_penalty": f32(0.0)},
     "repetition_penalty must be a finite number > 0"),  # the tensor wins, and is checked
]


@pytest.mark.parametrize("inputs,message", BAD_PENALTIES, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD_PENALTIES)])
def test_bad_penalties_are_invalid_arg(inputs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse({"text_input": s("a"), **inputs})
    assert not isinstance(e.value, io.UnsupportedError)
    assert io.error_code(e.value) == "INVALID_ARG"


def test_beam_width_and_length_penalty_unchanged():
    with pytest.raises(io.UnsupportedError, match="beam_width=4") as e:
        parse({"text_input": s("a"), "beam_width": np.array([[4]], np.int32)})
    assert io.error_code(e.value) == "UNSUPPORTED"
    one({"text_input": s("a"), "beam_width": np.array([[1]], np.int32), "length_penalty": f32(0.3)})  # ignored
    with pytest.raises(io.UnsupportedError, match="length_penalty=2.0"):
        parse({"text_input": s("a"), "sampling_parameters": vllm(length_penalty=2.0)})
    with pytest.raises(io.UnsupportedError, match="use_beam_search=True"):
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
    ({"text_input": s("a"), "top_k": np.array([[-2]], np.int32)}, "top_k"),
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
    assert io.error_code(e.value) in ("INVALID_ARG", "UNSUPPORTED")


@pytest.mark.parametrize("inputs", [
    {"guided_decoding_guide_type": s("json_schema"), "guided_decoding_guide": s('{"type": "object"}')},
    {"guided_decoding_guide_type": s("json")},
    {"sampling_parameters": s(json.dumps({"structured_outputs": json.dumps({"choice": ["yes", "no"]})}))},
    {"sampling_parameters": s(json.dumps({"guided_decoding": {"regex": "[0-9]+", "json": None, "choice": None}}))},
])
def test_guided_inputs_are_unsupported_when_the_engine_has_no_guided_decoding(inputs):
    with pytest.raises(io.UnsupportedError, match="guided decoding is not enabled yet") as e:
        parse({"text_input": s("a"), **inputs})
    assert io.error_code(e.value) == "UNSUPPORTED"


def test_guided_inputs_map_to_params_when_enabled():
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s("json_schema"),
             "guided_decoding_guide": s('{"type": "object"}')}, guided_enabled=True).request.guided
    assert (g.guide_type, g.guide) == ("json_schema", '{"type": "object"}')
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s(" Regex "), "guided_decoding_guide": s("[a-z]+")},
            guided_enabled=True).request.guided
    assert (g.guide_type, g.guide) == ("regex", "[a-z]+")  # guided.params normalizes the type
    g = one({"text_input": s("a"), "guided_decoding_guide_type": s("json"), "guided_decoding_guide": s("")},
            guided_enabled=True).request.guided
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
                g = one({"text_input": s("a"), "sampling_parameters": vllm(**{key: value})},
                        guided_enabled=True).request.guided
                assert (g.guide_type, g.guide) == expected, (key, value)


def test_guided_mapping_is_guided_params():
    """io has no guided mapping of its own: what it returns is guided.params.resolve_guided's answer."""
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
        assert one(inputs, guided_enabled=True).request.guided == gp.resolve_guided(gtype, guide, sp)


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


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("inputs,message", BAD_GUIDES, ids=[m for _, m in BAD_GUIDES])
def test_bad_guides_are_invalid_arg_with_guided_params_messages(inputs, message, enabled):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as e:
        parse({"text_input": s("a"), **inputs}, guided_enabled=enabled)
    assert io.error_code(e.value) == "INVALID_ARG"


def test_vllm_sampling_still_maps_with_a_guide():
    p = one({"text_input": s("a"), "sampling_parameters": vllm(max_tokens="9", temperature=0,
                                                                 structured_outputs={"choice": ["yes", "no"]})},
            guided_enabled=True)
    assert p.request.params.max_tokens == 9 and p.request.params.greedy
    assert p.request.guided.guide_type == "choice"


def test_error_codes():
    assert io.error_code(InvalidRequestError("x")) == "INVALID_ARG"
    assert io.error_code(io.UnsupportedError("x")) == "UNSUPPORTED"
    assert io.error_code(QueueFullError("x")) == "UNAVAILABLE"
    assert io.error_code(RuntimeError("x")) == "INTERNAL"
    resp = io.error_response(pb, "bad", "INVALID_ARG")
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
    st = io.SequenceStream(p)
    a = st.on_output(out("He", [1, 2], n_out=2))
    assert st.on_output(out("", [], n_out=2)) is None  # nothing new: nothing sent
    b = st.on_output(out("llo", [3], finished=True, reason="length", n_out=3))
    assert [texts(a), texts(b)] == ["He", "llo"]
    assert not a.finished and b.finished
    assert a.outputs["text_output"].shape == (1, 1)
    assert a.outputs["output_ids"].tolist() == [[1, 2]] and a.outputs["output_ids"].dtype == np.int32
    assert a.outputs["finish_reason"].tolist() == [[b""]] and b.outputs["finish_reason"].tolist() == [[b"length"]]
    assert b.outputs["num_output_tokens"].tolist() == [[1]] and b.outputs["num_output_tokens"].dtype == np.uint32
    assert b.outputs["num_input_tokens"].tolist() == [[3]]
    assert "total_draft_tokens" not in b.outputs


def test_non_streaming_accumulates_into_exactly_one_payload_with_echo():
    p = one({"text_input": s("Hi"), "return_num_output_tokens": np.array([[True]])})
    st = io.SequenceStream(p)
    assert st.on_output(out(" there", [1, 2], n_out=2)) is None
    final = st.on_output(out("!", [3], finished=True, reason="stop", n_out=3))
    assert texts(final) == "Hi there!"
    assert final.outputs["output_ids"].tolist() == [list(b"Hi") + [1, 2, 3]]
    assert final.outputs["num_output_tokens"].tolist() == [[3]]
    assert final.finished


def test_stream_with_echo_prepends_prompt_to_first_delta_only():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "exclude_input_in_output": np.array([[False]])})
    st = io.SequenceStream(p)
    assert texts(st.on_output(out("a", [1]))) == "Hia"
    assert texts(st.on_output(out("b", [2], finished=True, reason="stop"))) == "b"


def test_error_and_cancel_events_become_error_payloads():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]])})
    e = io.SequenceStream(p).on_output(out("", [], finished=True, reason="error", error="boom"))
    assert e.error == "boom" and e.error_code == "INTERNAL" and e.finished
    c = io.SequenceStream(p).on_output(out("", [], finished=True, reason="cancelled"))
    assert c.error_code == "CANCELLED" and c.finished
    resp = io.to_response(pb, c)
    assert resp.err.code() == FakeTritonError.CANCELLED


@pytest.mark.parametrize("code,expected", [
    (None, "INTERNAL"), ("INTERNAL", "INTERNAL"), ("INVALID_ARG", "INVALID_ARG"), ("invalid_arg", "INVALID_ARG"),
    ("UNAVAILABLE", "UNAVAILABLE"), ("BOGUS", "INTERNAL"),
])
def test_error_event_code_comes_from_the_engine_event(code, expected):
    p = one({"text_input": s("Hi"), "stream": np.array([[True]])})
    o = out("", [], finished=True, reason="error", error="grammar compile failed: bad regex")
    o.error_code = code
    e = io.SequenceStream(p).on_output(o)
    assert e.error == "grammar compile failed: bad regex" and e.error_code == expected and e.finished
    resp = io.to_response(pb, e)
    assert resp.err.code() == getattr(FakeTritonError, expected) and resp.err.message() == e.error


def test_perf_metrics_outputs_when_asked():
    p = one({"text_input": s("Hi"), "stream": np.array([[True]]), "return_perf_metrics": np.array([[True]])})
    o = out("a", [1], finished=True, reason="stop")
    o.total_draft_tokens, o.total_accepted_draft_tokens = 6, 3
    pl = io.SequenceStream(p).on_output(o)
    assert pl.outputs["total_draft_tokens"].tolist() == [[6]]
    assert pl.outputs["acceptance_rate"].tolist() == [[0.5]]
    resp = io.to_response(pb, pl)
    assert set(resp.tensors) == {"text_output", "output_ids", "finish_reason", "batch_index",
                                 "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate"}


def test_batch_index_output():
    rows = parse({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "stream": np.array([[True], [True]])})
    pl = io.SequenceStream(rows[1]).on_output(out("x", [1]))
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
    assert {k: v[:2] for k, v in inputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in io.INPUTS}
    assert all(opt for _, _, opt in inputs.values()), "every input is optional"
    assert {k: v[:2] for k, v in outputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in io.OUTPUTS}
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
    assert cfg.max_slots >= 1


def test_readme_documents_every_input_with_its_default():
    readme = (ROOT / "README.md").read_text()
    for sp in io.INPUTS:
        assert f"`{sp.name}`" in readme, sp.name
    for sp in io.OUTPUTS:
        assert f"`{sp.name}`" in readme, sp.name


def test_readme_lists_every_engine_setting():
    from specguide.config import EngineConfig

    readme = (ROOT / "README.md").read_text()
    settings = readme[readme.index("**Engine settings**"):]
    missing = [f for f in EngineConfig.__dataclass_fields__ if f"`{f}`" not in settings]
    assert not missing, f"README's engine settings miss {missing}"


def test_client_sends_the_declared_dtypes():
    from client.common import INPUT_TYPES

    triton = {"TYPE_STRING": "BYTES"}
    assert set(INPUT_TYPES) == set(io.INPUT_NAMES)
    for sp in io.INPUTS:
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
    """Emits `max_tokens` one-token events per request from its own thread, one every few ms."""

    instances = []

    def __init__(self, config):
        import threading

        self.config, self.tokenizer, self.supports_guided_decoding = config, TOK, False
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
        return {"active_slots": 0, "queue_depth": 0}

    def is_alive(self):
        return True

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
    import specguide.engine

    monkeypatch.setattr(specguide.engine, "Engine", FakeEngine)
    adapter = importlib.import_module("specguide.triton.adapter")
    m = adapter.TritonPythonModel()
    m.initialize({"model_config": json.dumps({"model_transaction_policy": {"decoupled": True},
                                              "parameters": {"max_slots": {"string_value": "2"}, "warmup": {"string_value": "false"}}}),
                  "model_name": "specguide", "model_version": "1"})
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
    assert [r.tensors["text_output"][0, 0] for r, _ in req.sender.sent] == [b"t1", b"t2", b"t3"]
    assert model.engine.config.max_slots == 2  # config.pbtxt parameters reach the engine
    fam = FakeMetricFamily.families
    wait_for(lambda: fam["specguide_generation_tokens_total"].metrics[(("model", "specguide"), ("version", "1"))].value == 3)
    assert len(fam["specguide_time_to_first_token_seconds"].metrics[(("model", "specguide"), ("version", "1"))].observed) == 1


def test_adapter_non_streaming_sends_exactly_one_final_response(model):
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[4]], np.int32)})
    model.execute([req])
    wait_for(req.sender.finished)
    assert len(req.sender.sent) == 1 and req.sender.sent[0][1] == 1
    assert req.sender.sent[0][0].tensors["text_output"][0, 0] == b"Hit1t2t3t4"


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


def test_adapter_guide_error_after_submit_is_invalid_arg_and_others_run(model):
    model.guided_enabled = True  # as with an engine that supports guided decoding
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
    wait_for(lambda: fam[(("finish_reason", "error"), ("model", "specguide"), ("version", "1"))].value == 1)


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
    from specguide import faults

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
    assert not model.is_ready()
    req = FakeTritonRequest({"text_input": s("Hi")})
    model.execute([req])
    (resp, flags), = req.sender.sent
    assert flags == 1 and resp.err.code() == FakeTritonError.UNAVAILABLE and "engine stopped" in resp.err.message()
    assert model.engine.submitted == []
    alive = FakeMetricFamily.families["specguide_engine_alive"].metrics[(("model", "specguide"), ("version", "1"))]
    wait_for(lambda: alive.value == 0.0)


def test_adapter_engine_death_event_is_unavailable_and_cancels_count_by_stage(model):
    out = RequestOutput(seq_id=1, finished=True, finish_reason="error", error="the engine stopped", error_code="UNAVAILABLE")
    assert io.event_error_code(out) == "UNAVAILABLE"
    req = FakeTritonRequest({"text_input": s("Hi"), "max_tokens": np.array([[500]], np.int32), "stream": np.array([[True]])})
    model.execute([req])
    wait_for(lambda: len(req.sender.sent) >= 1)
    seq = next(iter(model._live))
    model._deliver(seq, RequestOutput(seq_id=seq.seq_id, finished=True, finish_reason="cancelled", stage="decode"), 0.0)
    stages = FakeMetricFamily.families["specguide_cancellations_total"].metrics
    assert stages[(("model", "specguide"), ("stage", "decode"), ("version", "1"))].value == 1
    assert req.sender.sent[-1][1] == 1 and req.sender.sent[-1][0].err.code() == FakeTritonError.CANCELLED


def test_adapter_finalize_uses_the_drain_timeout(model):
    engine = model.engine
    model.finalize()
    assert engine.shutdown_args == (True, model.config.drain_timeout_s)
