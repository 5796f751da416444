"""The product as operators use it: a real tritonserver, tritonclient gRPC streaming, HTTP generate."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from client.common import GrpcStream, http_generate, http_generate_stream

from .conftest import MODEL, ROOT
from .helpers import I, S, raw_stream

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of robotics are",
    "import numpy as np\n",
    "My favourite season is",
]
MAX_TOKENS = 12


def config_parameters() -> dict:
    text = (ROOT / "model_repository" / MODEL / "config.pbtxt").read_text()
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}', text))


@pytest.fixture(scope="session")
def reference():
    """Greedy outputs of an in-process Engine with the served configuration: prompt -> (ids, text, reason)."""
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine
    from specguide.request import Request, SamplingParams

    cfg = EngineConfig.from_parameters({**config_parameters(), "warmup": "false"})
    engine = Engine(cfg)
    refs = {}
    try:
        for p in PROMPTS:
            outs = list(engine.generate(Request(prompt=p, params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))))
            refs[p] = ([t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish_reason)
    finally:
        engine.shutdown()
    return refs


def texts(results):
    return [r.as_numpy("text_output") for r, _, _ in results]


def test_grpc_stream_ends_with_final_and_equals_engine_output(server, reference):
    prompt = PROMPTS[0]
    ids, text, reason = reference[prompt]
    got = raw_stream(server, {"text_input": S(prompt), "max_tokens": I(MAX_TOKENS), "stream": np.array([[True]])})
    assert all(err is None for _, err, _ in got)
    assert [f for _, _, f in got] == [False] * (len(got) - 1) + [True]
    assert len(got) > 1, "streaming sends more than one response"
    outs = texts(got)
    assert all(o.shape == (1,) for o in outs), "exactly one string per response, 1-D (as the TRT-LLM ensemble)"
    assert "".join(o[0].decode() for o in outs) == text
    assert [int(t) for r, _, _ in got for t in r.as_numpy("output_ids").reshape(-1)] == ids
    assert got[-1][0].as_numpy("finish_reason")[0, 0].decode() == reason
    assert all(r.as_numpy("finish_reason")[0, 0] == b"" for r, _, _ in got[:-1])


def test_grpc_non_streaming_gets_exactly_one_final_response(server, reference):
    prompt = PROMPTS[1]
    ids, text, reason = reference[prompt]
    got = raw_stream(server, {"text_input": S(prompt), "max_tokens": I(MAX_TOKENS),
                              "exclude_input_in_output": np.array([[True]]),
                              "return_num_output_tokens": np.array([[True]]), "return_num_input_tokens": np.array([[True]])})
    assert len(got) == 1 and got[0][2] and got[0][1] is None
    r = got[0][0]
    assert r.as_numpy("text_output")[0].decode() == text
    assert r.as_numpy("output_ids").reshape(-1).tolist() == ids
    assert int(r.as_numpy("num_output_tokens")[0, 0]) == len(ids)
    assert int(r.as_numpy("num_input_tokens")[0, 0]) > 0


def test_batch_request_gives_sequences_with_batch_index(server, reference):
    p0, p1 = PROMPTS[0], PROMPTS[3]
    got = raw_stream(server, {"text_input": np.array([[p0.encode()], [p1.encode()]], dtype=np.object_),
                              "max_tokens": np.array([[MAX_TOKENS], [MAX_TOKENS]], np.int32),
                              "stream": np.array([[True], [True]])})
    assert got[-1][2] and sum(f for _, _, f in got) == 1
    by_row = {0: "", 1: ""}
    for r, err, _ in got:
        assert err is None
        by_row[int(r.as_numpy("batch_index")[0, 0])] += r.as_numpy("text_output")[0].decode()
    assert by_row == {0: reference[p0][1], 1: reference[p1][1]}


def test_http_generate_returns_one_response(server, reference):
    prompt = PROMPTS[0]
    ids, text, reason = reference[prompt]
    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
                       "return_num_output_tokens": True}).encode()
    with urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/generate", data=body, timeout=120) as r:
        d = json.loads(r.read())
    assert d["text_output"] == text and d["finish_reason"] == reason
    assert d["output_ids"] == ids and d["num_output_tokens"] == len(ids)
    # the default for a non-streaming request echoes the prompt (TensorRT-LLM and vLLM backends do too)
    c = http_generate({"text_input": prompt, "max_tokens": MAX_TOKENS}, server.http)
    assert c.error is None and c.text == prompt + text


def test_http_generate_stream_sends_sse_events(server, reference):
    prompt = PROMPTS[3]
    ids, text, reason = reference[prompt]
    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    with urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/generate_stream", data=body, timeout=120) as r:
        raw = r.read().decode()
    events = [json.loads(line[len("data:"):]) for line in raw.split("\n\n") if line.startswith("data:")]
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == text
    assert [e["finish_reason"] for e in events] == [""] * (len(events) - 1) + [reason]
    chunks = list(http_generate_stream({"text_input": prompt, "max_tokens": MAX_TOKENS}, server.http))
    assert "".join(c.text for c in chunks) == text and chunks[-1].final


def test_eight_concurrent_streams_all_complete(server, reference):
    results: dict[str, list] = {}

    def user(prompt):
        s = GrpcStream(server.grpc)
        try:
            results[prompt] = list(s.generate({"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}, timeout=300))
        finally:
            s.close()

    threads = [threading.Thread(target=user, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert set(results) == set(PROMPTS)
    for prompt, chunks in results.items():
        assert all(c.error is None for c in chunks), chunks[-1].error
        assert chunks[-1].final and not any(c.final for c in chunks[:-1])
        ids, text, reason = reference[prompt]
        assert "".join(c.text for c in chunks) == text, prompt
        assert [t for c in chunks for t in c.token_ids] == ids
        assert chunks[-1].finish_reason == reason
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0


def test_cancel_mid_stream_frees_the_slot(server, reference):
    cancelled_before = server.metric("specguide_requests_total", finish_reason="cancelled")
    got = raw_stream(server, {"text_input": S(PROMPTS[5]), "max_tokens": I(1000), "stream": np.array([[True]])},
                     cancel_after=3)
    assert len(got) == 3 and not any(f for _, _, f in got)
    t0 = time.monotonic()
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=10) == 0.0
    freed_after = time.monotonic() - t0
    assert freed_after < 5.0
    assert server.wait_metric("specguide_requests_total", cancelled_before + 1, finish_reason="cancelled") == cancelled_before + 1
    assert server.wait_metric("specguide_queue_depth", 0.0) == 0.0
    # new requests work
    ids, text, _ = reference[PROMPTS[0]]
    s = GrpcStream(server.grpc)
    try:
        assert "".join(c.text for c in s.generate({"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "stream": True})) == text
    finally:
        s.close()


BAD = [
    ({"text_input": S("hi"), "max_tokens": I(0)}, "max_tokens must be a positive integer"),
    ({"text_input": S("hi"), "temperature": I(-1.0, np.float32)}, "temperature"),
    ({"text_input": S("")}, "text_input is empty"),
    ({"text_input": S("hi"), "input_ids": I(1)}, "not both"),
    ({"max_tokens": I(4)}, "missing prompt"),
    ({"text_input": S("hi"), "top_p": I(1.5, np.float32)}, "top_p"),  # <= 0 is unset, as TRT-LLM
    ({"text_input": S("hi"), "num_draft_tokens": I(-2)}, "num_draft_tokens"),
    ({"text_input": S("hi"), "sampling_parameters": S("{oops")}, "not valid JSON"),
    ({"text_input": S("hello " * 9000)}, "max_seq_len"),  # past the model's 8,192: refused by the engine at submit
    ({"input_ids": np.array([[1, 10**8]], np.int32)}, "out of range"),  # refused by the engine
]


@pytest.mark.parametrize("inputs,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_gets_its_error_and_the_server_keeps_serving(server, inputs, message):
    # (gRPC stream errors carry only the message; the codes are checked in tests/unit/test_triton_requests.py)
    rejected = server.metric("specguide_requests_total", finish_reason="rejected")
    got = raw_stream(server, inputs)
    assert len(got) == 1
    _, err, final = got[0]
    assert err is not None and final
    assert message in err.message(), err.message()
    assert server.wait_metric("specguide_requests_total", rejected + 1, finish_reason="rejected") == rejected + 1
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
    c = http_generate({"text_input": "Hello", "max_tokens": 2, "exclude_input_in_output": True}, server.http)
    assert c.error is None and c.finish_reason in ("stop", "length")


def test_wrong_dtype_is_refused_by_triton_and_the_server_keeps_serving(server):
    got = raw_stream(server, {"text_input": S("hi"), "max_tokens": I(4.0, np.float32)})
    assert got[0][1] is not None and "max_tokens" in got[0][1].message()
    c = http_generate({"text_input": "Hello", "max_tokens": 2}, server.http)
    assert c.error is None


def test_http_errors_are_reported(server):
    body = json.dumps({"text_input": "hi", "max_tokens": 0}).encode()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/generate", data=body, timeout=60)
    assert e.value.code == 400 and "max_tokens" in json.loads(e.value.read())["error"]
    chunks = list(http_generate_stream({"text_input": "hi", "top_p": 2.0}, server.http))
    assert len(chunks) == 1 and "top_p" in chunks[0].error


def test_vllm_sampling_parameters_path(server, reference):
    ids, text, _ = reference[PROMPTS[0]]
    sp = json.dumps({"max_tokens": "5", "temperature": 0, "min_tokens": "1"})
    got = raw_stream(server, {"text_input": S(PROMPTS[0]), "sampling_parameters": S(sp), "stream": np.array([[True]]),
                              "exclude_input_in_output": np.array([[True]])})
    assert [int(t) for r, _, _ in got for t in r.as_numpy("output_ids").reshape(-1)] == ids[:5]


def test_seeded_sampling_is_reproducible(server):
    values = {"text_input": PROMPTS[3], "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 1234,
              "exclude_input_in_output": True}
    a, b = http_generate(values, server.http), http_generate(values, server.http)
    assert a.error is None and a.text == b.text and a.token_ids == b.token_ids


def test_custom_metrics_on_the_metrics_port(server):
    c = http_generate({"text_input": PROMPTS[0], "max_tokens": 3, "exclude_input_in_output": True}, server.http)
    assert c.error is None
    text = server.metrics_text()
    for family in ("specguide_requests_total", "specguide_prompt_tokens_total", "specguide_generation_tokens_total",
                   "specguide_time_to_first_token_seconds", "specguide_time_per_output_token_seconds",
                   "specguide_request_latency_seconds", "specguide_active_slots", "specguide_queue_depth"):
        assert f"# TYPE {family} " in text, family
    assert server.metric("specguide_prompt_tokens_total", model=MODEL) > 0
    assert server.metric("specguide_generation_tokens_total", model=MODEL) >= 3
    assert server.metric("specguide_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert server.metric("specguide_time_per_output_token_seconds_count", model=MODEL) >= 1
    assert server.metric("specguide_request_latency_seconds_count", model=MODEL) >= 1
    assert server.metric("specguide_requests_total", finish_reason="length") >= 1


def test_prefix_cache_output_and_metrics_move_on_a_repeated_prompt(server):
    chunk = int(config_parameters()["prefill_chunk"])
    prompt = "Count with me: " + ", ".join(str(i) for i in range(chunk))  # more than one prefill chunk
    inputs = {"text_input": S(prompt), "max_tokens": I(4), "return_num_input_tokens": np.array([[True]])}
    query = server.metric("specguide_prefix_cache_query_tokens_total", model=MODEL)
    hit = server.metric("specguide_prefix_cache_hit_tokens_total", model=MODEL)
    cached, n_in = [], 0
    for _ in range(2):
        got = raw_stream(server, inputs)
        assert len(got) == 1 and got[0][1] is None
        n_in = int(got[0][0].as_numpy("num_input_tokens")[0, 0])
        cached.append(int(got[0][0].as_numpy("num_cached_tokens")[0, 0]))
    # the prompt's whole 16-token blocks before its last token (>= 1 token computed): shared by block
    assert n_in > chunk and cached[1] == (n_in - 1) // 16 * 16
    assert server.wait_metric("specguide_prefix_cache_query_tokens_total", query + 2 * n_in, model=MODEL) == query + 2 * n_in
    want = hit + sum(cached)
    assert server.wait_metric("specguide_prefix_cache_hit_tokens_total", want, model=MODEL) == want
    assert "# TYPE specguide_prefix_cache_hit_tokens_total counter" in server.metrics_text()


def test_speculation_metrics(server):
    drafted = server.metric("specguide_draft_tokens_total", model=MODEL)
    steps = server.metric("specguide_tokens_per_step_count", model=MODEL)
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"
    c = http_generate({"text_input": prompt, "max_tokens": 24, "exclude_input_in_output": True}, server.http)
    assert c.error is None
    text = server.metrics_text()
    for family in ("specguide_draft_tokens_total", "specguide_accepted_draft_tokens_total", "specguide_tokens_per_step"):
        assert f"# TYPE {family} " in text, family
    assert server.metric("specguide_draft_tokens_total", model=MODEL) > drafted
    accepted = server.metric("specguide_accepted_draft_tokens_total", model=MODEL)
    assert 0 < accepted <= server.metric("specguide_draft_tokens_total", model=MODEL)
    new_steps = server.metric("specguide_tokens_per_step_count", model=MODEL) - steps
    # fewer steps than tokens: speculation emitted several tokens in some steps
    assert 0 < new_steps < 23


def test_cli_streams_and_calls_http(server, reference):
    ids, text, _ = reference[PROMPTS[0]]
    for proto, url in (("grpc", server.grpc), ("http", server.http), ("http-stream", server.http)):
        r = subprocess.run([sys.executable, "-m", "client.cli", PROMPTS[0], "--protocol", proto, "--url", url,
                            "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--stats"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout == text + "\n", proto
        assert f"output_tokens={len(ids)}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "client.cli", "hi", "--url", server.grpc, "--max-tokens", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "max_tokens" in r.stderr


def test_load_client_reports_genai_perf_metrics(server, tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "client.load", "--url", server.grpc, "--concurrency", "2", "--requests", "4",
                        "--max-tokens", "6", "--ignore-eos", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["requests"] == 4
    assert report["output_sequence_length"]["min"] == 6
    for key in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms"):
        assert report[key]["avg"] > 0
    assert report["output_token_throughput_per_s"] > 0
    assert "time to first token" in r.stdout
