"""specguide.triton.responses: engine events -> the payloads and Triton responses of each interface
(streamed deltas, one whole response, errors, log probs, merged unary rows), against a fake of
triton_python_backend_utils (no server needed)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specguide.request import InvalidRequestError
from specguide.triton.interfaces import INTERFACE_PARAMETER
from specguide.triton.responses import Payload, SequenceStream, UnsupportedError, merge_payloads, to_response
from triton_fakes import TOK, FakeTritonError, one, out, parse, pb, s, texts, vllm, vparse, vtext


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


# ---------------------------------------------------------------------------------- the three interfaces


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
