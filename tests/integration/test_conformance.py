"""Existing Triton clients, unchanged, against the three served names (issue 21).

`upstream/` holds the clients' own files (tensorrtllm_backend v0.19.0 `inflight_batcher_llm/client`,
vllm_backend `samples/client.py` and its CI tests): they run as they are, as subprocesses or by
calling their own request-building functions, against a real tritonserver.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .helpers import B, I, S, tensor_inputs

UPSTREAM = Path(__file__).resolve().parent / "upstream"
PROMPT = "The capital of France is"


def _model_dir() -> str:
    from specguide.models.default_model import prepare_default_model

    return str(prepare_default_model())


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(UPSTREAM)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(UPSTREAM))


def _stream(server, model: str, values: dict[str, np.ndarray], parameters=None, cancel_after: int = 0):
    """One request on a fresh gRPC stream: [(result, error)] until the stream closes (or cancel)."""
    client = grpcclient.InferenceServerClient(server.grpc)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, tensor_inputs(values), parameters=parameters, enable_empty_final_response=True)
    got = []
    try:
        while True:
            result, error = q.get(timeout=120)
            if error is not None:
                got.append((None, error))
                return got
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                got.append((result, None))
            if final or (cancel_after and len(got) >= cancel_after):
                return got
    finally:
        client.stop_stream(cancel_requests=bool(cancel_after))
        client.close()


def _greedy(server, prompt: str, n: int) -> tuple[str, list[int]]:
    got = _stream(server, "specguide", {"text_input": S(prompt), "max_tokens": I(n),
                                        "exclude_input_in_output": B(True)})
    r = got[-1][0]
    return r.as_numpy("text_output")[0].decode(), r.as_numpy("output_ids").reshape(-1).tolist()


# ------------------------------------------------------------------ TensorRT-LLM clients


def test_inflight_batcher_client_streaming_and_unary_unchanged(server):
    """tensorrtllm_backend's inflight_batcher_llm_client.py: streaming to `specguide`, `async_infer`
    (unary) to `specguide_unary`; input_ids, request_output_len, runtime_top_k=1 (greedy), streaming."""
    text, ids = _greedy(server, PROMPT, 8)
    common = ["inflight_batcher_llm_client.py", "-u", server.grpc, "--text", PROMPT, "--request-output-len", "8",
              "--tokenizer-dir", _model_dir(), "--return-log-probs", "--return-perf-metrics"]
    for extra in (["--model-name", "specguide", "--streaming"], ["--model-name", "specguide_unary"]):
        p = _run(common + extra)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert f"Output beam 0: {text}" in p.stdout, p.stdout[-2000:]
        assert "cum_log_probs:" in p.stdout and "arrival_time_ns:" in p.stdout


def _e2e():
    sys.path.insert(0, str(UPSTREAM))
    import end_to_end_grpc_client as e2e  # noqa: E402

    e2e.FLAGS = SimpleNamespace(check_outputs=False)
    return e2e


def _e2e_run(server, **kw):
    e2e = _e2e()
    args = dict(prompt=PROMPT, output_len=8, request_id="", repetition_penalty=None, presence_penalty=None,
                frequency_penalty=None, temperature=1.0, stop_words=[], bad_words=[], embedding_bias_words=None,
                embedding_bias_weights=None, model_name="specguide", streaming=False, beam_width=1,
                overwrite_output_text=False, return_log_probs_data=None, return_context_logits_data=None,
                return_generation_logits_data=None, return_perf_metrics_data=None, end_id=None, pad_id=None,
                batch_inputs=False, verbose=False)
    args.update(kw)
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        return e2e.run_inference(client, **args)[1]
    finally:
        client.close()


def test_end_to_end_grpc_client_requests(server):
    """end_to_end_grpc_client.py's own run_inference (its `--model-name` choices are the ensemble's):
    `output[0].decode()` on a 1-D text_output, the prompt never streamed, `[0][0]` on the rest."""
    text, _ = _greedy(server, PROMPT, 8)
    # temperature 0 with runtime defaults: greedy; non-streaming echoes the prompt unless excluded
    assert _e2e_run(server, temperature=0.0) == [PROMPT + text]
    assert _e2e_run(server, temperature=0.0, exclude_input_in_output=True) == [text]
    assert _e2e_run(server, temperature=0.0, streaming=True) == [text]  # never the prompt in a stream
    # two prompts batched in one request, with every optional output the client asks for
    prompts = json.dumps([PROMPT, "Once upon a time,"])
    flag = np.array([[True]], dtype=bool)
    outs = _e2e_run(server, prompt=prompts, temperature=0.0, streaming=True, batch_inputs=True,
                    return_log_probs_data=flag,
                    return_perf_metrics_data=flag)
    assert outs[0] == text and outs[1] == _greedy(server, "Once upon a time,", 8)[0]
    # num_return_sequences: sequence_index tells them apart; sampled, so they differ
    outs = _e2e_run(server, temperature=1.0, num_return_sequences=3, streaming=True,
                    exclude_input_in_output=True)
    assert len(outs) == 3 and all(outs) and len(set(outs)) > 1


def test_end_to_end_grpc_client_guided_decoding(server):
    """The guided-decoding command of tensorrtllm_backend docs/guided_decoding.md, over gRPC."""
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name", "age"], "additionalProperties": False})
    out = _e2e_run(server, prompt="Give me a person as JSON:", output_len=40, temperature=0.0,
                   exclude_input_in_output=True, guided_decoding_guide_type="json_schema",
                   guided_decoding_guide=schema)
    obj = json.loads(out[0])
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_embedding_bias_of_the_ensemble_and_of_tensorrt_llm(server):
    """The ensemble's embedding_bias_words / _weights and tensorrt_llm's dense embedding_bias reach
    the logits: a large weight on a word's token makes the greedy answer that token, a ban removes
    the greedy answer's first token."""
    text, ids = _greedy(server, PROMPT, 4)
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(4), "exclude_input_in_output": B(True),
                                        "embedding_bias_words": np.array([[b" zebra"]], np.object_),
                                        "embedding_bias_weights": np.array([[100.0]], np.float32)})
    assert got[-1][0].as_numpy("text_output")[0].decode() == " zebra" * 4
    from specguide.triton.input_limits import model_vocab_size

    dense = np.zeros((1, model_vocab_size(_model_dir())), np.float32)  # one value per token id, as TensorRT-LLM takes it
    dense[0, ids[0]] = -100.0
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(4), "exclude_input_in_output": B(True),
                                        "embedding_bias": dense})
    banned = got[-1][0].as_numpy("output_ids").reshape(-1).tolist()
    assert banned[0] != ids[0] and ids[0] not in banned
    short = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(4), "embedding_bias": dense[:, :-1]})
    assert short[-1][1] is not None and "embedding_bias has 49151 values" in short[-1][1].message()


def test_tensorrt_llm_core_names_over_grpc_and_http(server):
    """The `tensorrt_llm` model's own names: request_output_len, streaming, runtime_top_k/p,
    stop_words_list, output_ids [1, 1, n] and sequence_length; both spellings at once is an error."""
    text, ids = _greedy(server, PROMPT, 6)
    tok_ids = _greedy(server, PROMPT, 1)[1]
    prompt_ids = np.array([[int(x) for x in _prompt_ids(server)]], np.int32)
    got = _stream(server, "specguide", {"input_ids": prompt_ids, "input_lengths": I(prompt_ids.shape[1]),
                                        "request_output_len": I(6), "streaming": B(True), "runtime_top_k": I(0),
                                        "runtime_top_p": np.array([[0.0]], np.float32), "end_id": I(2),
                                        "pad_id": I(2), "beam_width": I(1)})
    streamed = [t for r, _ in got for t in r.as_numpy("output_ids")[0][0]]
    assert streamed == ids and all(r.as_numpy("output_ids").ndim == 3 for r, _ in got)
    assert [int(r.as_numpy("sequence_length")[0][0]) for r, _ in got] == [r.as_numpy("output_ids").shape[2] for r, _ in got]
    assert tok_ids == ids[:1]
    # over HTTP a scalar request_output_len is honoured, not ignored as a request parameter
    body = json.dumps({"text_input": PROMPT, "request_output_len": 3, "exclude_input_in_output": True}).encode()
    with urllib.request.urlopen(f"http://{server.http}/v2/models/specguide/generate", data=body, timeout=120) as r:
        d = json.loads(r.read())
    assert len(d["output_ids"]) == 3 and d["output_ids"] == ids[:3]
    # both spellings of one setting, and a key no interface knows, are errors naming them
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(3), "request_output_len": I(4)})
    assert "give either max_tokens or request_output_len" in got[-1][1].message()
    status, body = _http_post(server, "specguide", {"text_input": PROMPT, "max_tokens": 3, "draft_input_ids": 4})
    assert status == 400 and "unknown request parameter 'draft_input_ids'" in body
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "draft_input_ids": np.array([[4]], np.int32)})
    assert "draft_input_ids" in got[-1][1].message()  # not declared: Triton names it
    # a LoRA task id never sent with its weights: TensorRT-LLM's error, over HTTP and gRPC
    status, body = _http_post(server, "specguide", {"text_input": PROMPT, "max_tokens": 3, "lora_task_id": 4})
    assert status == 400 and "LoRA task 4 not found in cache" in body, body
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "lora_task_id": np.array([[4]], np.uint64)})
    assert "LoRA task 4 not found in cache" in got[-1][1].message()


def _prompt_ids(server) -> list[int]:
    got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(1)})  # echoes the prompt
    r = got[-1][0]
    return r.as_numpy("output_ids").reshape(-1).tolist()[:-1]


def _http_post(server, model: str, body: dict, endpoint: str = "generate") -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http}/v2/models/{model}/{endpoint}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ------------------------------------------------------------------ unary


def test_unary_model_infer_over_grpc_and_http(server):
    """`client.infer()` (gRPC ModelInfer) and HTTP /infer: the first call most Triton users write."""
    text, ids = _greedy(server, PROMPT, 6)
    client = grpcclient.InferenceServerClient(server.grpc)
    r = client.infer("specguide_unary", tensor_inputs({"text_input": S(PROMPT), "max_tokens": I(6),
                                                      "exclude_input_in_output": B(True), "top_p": np.array([[0.0]], np.float32)}))
    assert r.as_numpy("text_output")[0].decode() == text
    assert r.as_numpy("output_ids").tolist() == [[ids]] and r.as_numpy("sequence_length").tolist() == [[6]]
    # two rows x two return sequences: one response, rows stacked on the first axis
    r = client.infer("specguide_unary", tensor_inputs({
        "text_input": np.array([[PROMPT.encode()], [b"Once upon a time,"]], dtype=np.object_),
        "max_tokens": np.array([[6], [6]], np.int32), "exclude_input_in_output": np.array([[True], [True]]),
        "num_return_sequences": np.array([[2], [2]], np.int32)}))
    assert r.as_numpy("text_output").shape == (4,)
    assert r.as_numpy("batch_index").reshape(-1).tolist() == [0, 0, 1, 1]
    assert r.as_numpy("sequence_index").reshape(-1).tolist() == [0, 1, 0, 1]
    assert r.as_numpy("text_output")[0].decode() == text == r.as_numpy("text_output")[1].decode()  # greedy
    with pytest.raises(Exception, match="stream=true needs a decoupled model"):
        client.infer("specguide_unary", tensor_inputs({"text_input": S(PROMPT), "stream": B(True)}))
    client.close()
    http = httpclient.InferenceServerClient(server.http)
    x = httpclient.InferInput("text_input", [1, 1], "BYTES")
    x.set_data_from_numpy(S(PROMPT))
    n = httpclient.InferInput("request_output_len", [1, 1], "INT32")
    n.set_data_from_numpy(I(6))
    r = http.infer("specguide_unary", [x, n])
    assert r.as_numpy("text_output")[0].decode() == PROMPT + text  # the prompt is part of a whole answer
    http.close()


# ------------------------------------------------------------------ vLLM clients


def test_concurrent_unary_requests_leave_the_server_up(server):
    """16 `infer()` calls through specguide_unary, 4 at a time, each long enough to be polled for
    cancellation many times: the poll must never ask a finished request's sender (Triton freed its
    response factory: the server died with SIGSEGV here)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        client = grpcclient.InferenceServerClient(server.grpc)
        try:
            r = client.infer("specguide_unary", tensor_inputs({"text_input": S(f"{PROMPT} {i}"), "max_tokens": I(24),
                                                              "return_num_output_tokens": B(True),
                                                              "sampling_parameters": S('{"ignore_eos": true}')}))
            return int(r.as_numpy("num_output_tokens").reshape(-1)[0])
        finally:
            client.close()
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(8))) == [24] * 8
    assert _greedy(server, PROMPT, 2)[1]  # still serving
    assert "Signal (11)" not in server.log.read_text(errors="replace")


def test_vllm_sample_client_unchanged(server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nThe most dangerous animal is\n")
    results = tmp_path / "results.txt"
    p = _run(["vllm_client.py", "-m", "specguide_vllm", "-u", server.grpc, "--input-prompts", str(prompts),
              "--results-file", str(results)])
    assert p.returncode == 0 and "PASS: vLLM example" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    text = results.read_text()
    assert "Hello, my name is" in text and "The most dangerous animal is" in text  # echoed: not streaming


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_vllm_additional_outputs_ci_test(server, stream, logprobs):
    """vllm_backend's ci/L0_additional_outputs_vllm test, its own assertions, pointed at specguide_vllm."""
    sys.path.insert(0, str(UPSTREAM))
    from additional_outputs_test import TestAdditionalOutputs  # noqa: E402

    t = TestAdditionalOutputs()
    # its class knobs: where to send, and a prompt this model continues past 16 tokens (its own
    # prompt ends in EOS here, and the test wants finish_reason `length`)
    t._grpc_url, t._model_name, t._prompt = server.grpc, "specguide_vllm", "The most dangerous animal is"
    t.test_additional_outputs(stream, True, True, logprobs, True, True, True)
    t.test_additional_outputs(stream, None, False, logprobs, None, False, None)


def test_vllm_stream_errors_and_defaults(server):
    """vllm_backend's enabled_stream test: deltas by default; its exact error for a streamed echo."""
    sys.path.insert(0, str(UPSTREAM))
    from test_util import create_vllm_request  # noqa: E402

    sp = {"temperature": "0", "top_p": "1"}
    req = create_vllm_request("The most dangerous animal is", 1, True, sp, "specguide_vllm",
                              exclude_input_in_output=False)
    client = grpcclient.InferenceServerClient(server.grpc)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(**req)
    result, error = q.get(timeout=60)
    assert error is not None and error.message() == \
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    client.stop_stream()
    client.close()
    got = _stream(server, "specguide_vllm", {"text_input": np.array([b"The most dangerous animal is"], np.object_),
                                             "stream": np.array([True]),
                                             "sampling_parameters": np.array([json.dumps(sp).encode()], np.object_)})
    deltas = [r.as_numpy("text_output")[0].decode() for r, _ in got]
    engine = _stream(server, "specguide", {"text_input": S("The most dangerous animal is"), "max_tokens": I(16),
                                           "exclude_input_in_output": B(True)})
    assert "".join(deltas) == engine[-1][0].as_numpy("text_output")[0].decode()  # vLLM's default length: 16
    assert all(r.as_numpy("text_output").shape == (1,) for r, _ in got)
    bad = _stream(server, "specguide_vllm", {"text_input": np.array([b"Hi"], np.object_),
                                             "sampling_parameters": np.array([b'{"max_tokenz": 3}'], np.object_)})
    assert bad[-1][1].message() == "Error generating stream: sampling_parameters: unknown key 'max_tokenz'"


def test_one_engine_serves_every_name(server):
    """One copy of the weights: the proxies hold no model; their requests run in `specguide`'s engine."""
    before = server.metric("specguide_requests_total", finish_reason="length")
    client = grpcclient.InferenceServerClient(server.grpc)
    client.infer("specguide_unary", tensor_inputs({"text_input": S(PROMPT), "max_tokens": I(2)}))
    client.close()
    _stream(server, "specguide_vllm", {"text_input": np.array([PROMPT.encode()], np.object_),
                                       "sampling_parameters": np.array([b'{"max_tokens": 2}'], np.object_)})
    assert server.wait_metric("specguide_requests_total", before + 2, finish_reason="length") == before + 2
    rss = server.stub_rss_by_model()
    assert set(rss) == {"specguide", "specguide_unary", "specguide_vllm"}
    assert rss["specguide_unary"] < 150 * 2**20 and rss["specguide_vllm"] < 150 * 2**20, rss
    assert rss["specguide"] > 4 * max(rss["specguide_unary"], rss["specguide_vllm"]), rss


def test_cancel_through_the_vllm_proxy_frees_the_slot(server):
    before = server.metric("specguide_cancellations_total", stage="decode")
    got = _stream(server, "specguide_vllm", {"text_input": np.array([b"Count to a thousand:"], np.object_),
                                             "stream": np.array([True]),
                                             # NOTE: long enough to be decoding when the cancel lands (a fast
                                             # CPU writes 400 counting tokens in 0.7 s)
                                             "sampling_parameters": np.array([b'{"max_tokens": 2000, "temperature": 0}'],
                                                                             np.object_)}, cancel_after=2)
    assert len(got) == 2 and got[-1][1] is None
    assert server.wait_metric("specguide_cancellations_total", before + 1, timeout=30, stage="decode") == before + 1
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=30) == 0.0


def test_log_probs_are_the_same_with_speculation_on_and_off(server):
    """TensorRT-LLM's return_log_probs: greedy at K=0 and K=3 (the served maximum; K=4 in the engine
    tests) gives the same tokens and log probs."""
    runs = {}
    for k in (0, 3):
        got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(16), "num_draft_tokens": I(k),
                                            "stream": B(True), "return_log_probs": B(True),
                                            "sampling_parameters": S('{"ignore_eos": true, "temperature": 0}')})
        ids = [t for r, _ in got for t in r.as_numpy("output_ids")[0][0]]
        lps = [x for r, _ in got for x in r.as_numpy("output_log_probs")[0][0]]
        cum = float(got[-1][0].as_numpy("cum_log_probs")[0][0])
        runs[k] = (ids, np.array(lps), cum)
        assert len(lps) == len(ids) == 16 and all(x <= 0 for x in lps)
        assert cum == pytest.approx(float(np.sum(lps)), abs=1e-4)
    assert runs[0][0] == runs[3][0]
    np.testing.assert_allclose(runs[0][1], runs[3][1], atol=1e-4)


def test_stop_words_end_on_token_sequences_and_stay_in_the_output(server):
    """TensorRT-LLM matches stop words as token sequences and keeps them; text and ids agree."""
    text, ids = _greedy(server, PROMPT, 12)
    word = text.split()[0]  # " Paris." -> "Paris." is not its token sequence; " Paris" is
    stop = " " + word.rstrip(".")
    for stream in (False, True):
        got = _stream(server, "specguide", {"text_input": S(PROMPT), "max_tokens": I(12), "stop_words": S(stop),
                                            "exclude_input_in_output": B(True), "stream": B(stream)})
        out_text = "".join(r.as_numpy("text_output")[0].decode() for r, _ in got)
        out_ids = [t for r, _ in got for t in r.as_numpy("output_ids")[0][0]]
        assert out_text == stop and out_ids == ids[:len(out_ids)] and len(out_ids) < 12
        assert got[-1][0].as_numpy("finish_reason")[0][0] == b"stop"
