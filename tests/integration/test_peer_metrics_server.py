"""The vLLM and TensorRT-LLM backends' metric families on the real server's /metrics: traffic
through each served name (gRPC stream and HTTP generate) moves that name's series by exactly the
requests and tokens sent; the engine's nv_trt_llm_* gauges show its slots, KV blocks and steps."""
from __future__ import annotations

import json
import queue
import re
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from specguide.triton import peer_metrics as pm

from .conftest import MODEL
from .helpers import raw_stream, tensor_inputs

NAMES = ("specguide", "specguide_unary", "specguide_vllm")
PROMPT = "Write one sentence about the sea."
VLLM_FAMILIES = {
    "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_best_of": "histogram",
}
TRTLLM_FAMILIES = {  # family: (kind, category label, its values)
    **{name: ("gauge", category, set(values)) for name, (_, category, values) in pm.TRTLLM_GAUGES.items()},
    pm.TRTLLM_DISAGG[0]: ("counter", pm.TRTLLM_DISAGG[2], set(pm.TRTLLM_DISAGG[3])),
    "nv_llm_input_token_len": ("histogram", "response_metric_type", {"total_input_tokens"}),
    "nv_llm_output_token_len": ("histogram", "response_metric_type", {"total_output_tokens"}),
}


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = re.match(r"([\w:]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if m and not line.startswith("#"):
            out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))))
    return out


def value(text: str, name: str, **labels: str) -> float:
    got = [v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(got) == 1, (name, labels, got)
    return got[0]


def stream(server, model: str, inputs: dict[str, np.ndarray]) -> list:
    """One request on a gRPC stream; every response (errors fail the test)."""
    got = raw_stream(server, inputs, timeout=300, model=model)
    assert all(error is None for _, error, _ in got), got
    return [result for result, _, _ in got]


def http_generate(server, model: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{server.http}/v2/models/{model}/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def tokens_of(results: list) -> tuple[int, int, int]:
    """(prompt tokens, generated tokens, responses that carried tokens) of one request's responses."""
    n_in = n_out = with_tokens = 0
    for r in results:
        a = r.as_numpy("num_input_tokens")
        b = r.as_numpy("num_output_tokens")
        if a is not None:
            n_in = int(np.asarray(a).reshape(-1)[0])
        if b is not None and int(np.asarray(b).reshape(-1)[0]) > 0:
            n_out += int(np.asarray(b).reshape(-1)[0])
            with_tokens += 1
    return n_in, n_out, with_tokens


def one(v, dtype):
    return np.array([[v]], dtype=dtype)


def send_traffic(server) -> dict[str, dict[str, int]]:
    """Two requests through each name (a gRPC stream, an HTTP generate); what each was told it got."""
    sent = {name: {"requests": 0, "prompt": 0, "generated": 0, "steps": 0} for name in NAMES}

    def add(name, n_in, n_out, steps=0):
        s = sent[name]
        s["requests"] += 1
        s["prompt"] += n_in
        s["generated"] += n_out
        s["steps"] += steps

    trt = {"text_input": one(PROMPT.encode(), np.object_), "max_tokens": one(9, np.int32),
           "min_tokens": one(9, np.int32), "num_draft_tokens": one(0, np.int32),  # one token a step
           "return_num_input_tokens": one(True, np.bool_), "return_num_output_tokens": one(True, np.bool_)}
    n_in, n_out, steps = tokens_of(stream(server, "specguide", {**trt, "stream": one(True, np.bool_)}))
    assert n_out == 9 and steps == 9
    add("specguide", n_in, n_out, steps)
    (r,) = stream(server, "specguide_unary", trt)
    n_in, n_out, _ = tokens_of([r])
    add("specguide_unary", n_in, n_out, n_out)
    vllm = {"text_input": np.array([PROMPT.encode()], dtype=np.object_), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps({"max_tokens": 7, "min_tokens": 7, "temperature": 0}).encode()],
                                            dtype=np.object_),
            "return_num_input_tokens": np.array([True]), "return_num_output_tokens": np.array([True])}
    n_in, n_out, _ = tokens_of(stream(server, "specguide_vllm", vllm))
    assert n_out == 7
    add("specguide_vllm", n_in, n_out)
    for name, body in (
        ("specguide", {"text_input": PROMPT, "max_tokens": 5, "min_tokens": 5, "num_draft_tokens": 0,
                       "return_num_input_tokens": True, "return_num_output_tokens": True}),
        ("specguide_unary", {"text_input": PROMPT, "max_tokens": 6, "min_tokens": 6, "num_draft_tokens": 0,
                             "return_num_input_tokens": True, "return_num_output_tokens": True}),
        ("specguide_vllm", {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 4, "min_tokens": 4}),
                            "return_num_input_tokens": True, "return_num_output_tokens": True}),
    ):
        d = http_generate(server, name, body)
        n_in, n_out = int(np.asarray(d["num_input_tokens"]).reshape(-1)[0]), int(np.asarray(d["num_output_tokens"]).reshape(-1)[0])
        assert n_out == body.get("max_tokens", 4)
        add(name, n_in, n_out, n_out if name != "specguide_vllm" else 0)
    return sent


def test_the_peer_backends_families_count_the_traffic_of_each_served_name(server):
    before = server.metrics_text()
    sent = send_traffic(server)
    # every sequence's last response is sent after its metrics are recorded (the response thread
    # records, then sends); the engine's stats reach the gauges within STATS_IDLE_S once it is idle:
    # wait for the iteration counter to count this traffic's steps before reading the gauges
    it = "nv_trt_llm_general_metrics", "general_type", "iteration_counter"
    steps = sum(s["steps"] for s in sent.values())
    counted = lambda text: value(text, it[0], model=MODEL, general_type=it[2]) - \
        value(before, it[0], model=MODEL, general_type=it[2])  # noqa: E731
    deadline = time.monotonic() + 10
    while counted(after := server.metrics_text()) < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    server.wait_metric("nv_trt_llm_request_metrics", 0.0, request_type="active", model=MODEL)
    after = server.metrics_text()

    for family, kind in VLLM_FAMILIES.items():
        assert f"# TYPE {family} {kind}" in after, family
    for family, (kind, _, _) in TRTLLM_FAMILIES.items():
        assert f"# TYPE {family} {kind}" in after, family

    for name in NAMES:
        s = sent[name]
        lab = {"model": name, "version": "1"}
        delta = lambda metric, **extra: value(after, metric, **lab, **extra) - value(before, metric, **lab, **extra)  # noqa: E731
        assert s["prompt"] > 0 and s["requests"] == 2
        assert delta("vllm:prompt_tokens_total") == s["prompt"], name
        assert delta("vllm:generation_tokens_total") == s["generated"], name
        for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                  "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_best_of"):
            assert delta(f"{h}_count") == s["requests"], (name, h)
        assert delta("vllm:request_prompt_tokens_sum") == s["prompt"], name
        assert delta("vllm:request_generation_tokens_sum") == s["generated"], name
        assert delta("vllm:request_params_n_sum") == s["requests"], name  # n = 1
        tpot = delta("vllm:time_per_output_token_seconds_count")  # one per engine step after the first
        if s["steps"]:  # speculation off (num_draft_tokens 0): one token a step
            assert tpot == s["steps"] - s["requests"], name
        else:  # specguide_vllm speculates: at most one per token
            assert 1 <= tpot <= s["generated"] - s["requests"], name
        assert delta("nv_llm_input_token_len_count", response_metric_type="total_input_tokens") == s["requests"]
        assert delta("nv_llm_input_token_len_sum", response_metric_type="total_input_tokens") == s["prompt"]
        assert delta("nv_llm_output_token_len_sum", response_metric_type="total_output_tokens") == s["generated"]
        # the vLLM backend's buckets
        assert value(after, "vllm:e2e_request_latency_seconds_bucket", **lab, le="60") <= \
            value(after, "vllm:e2e_request_latency_seconds_bucket", **lab, le="+Inf")

    # labels exactly as the backends label them
    for n, lab, _ in samples(after):
        base = re.sub(r"_(count|sum|bucket)$", "", n)
        if base in VLLM_FAMILIES:
            assert set(lab) - {"le"} == {"model", "version"} and lab["model"] in NAMES, (n, lab)
        elif base in TRTLLM_FAMILIES:
            _, category, values = TRTLLM_FAMILIES[base]
            assert set(lab) - {"le"} == {"model", "version", category} and lab[category] in values, (n, lab)
            if base.startswith("nv_trt_llm_"):
                assert lab["model"] == MODEL, (n, lab)
    # the engine's figures once idle: nothing held, steps counted
    config = json.loads(urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/config", timeout=10).read())
    max_seq_len = int(config["parameters"]["max_seq_len"]["string_value"]) or 8192  # 0: the model's context
    g = lambda fam, cat, v: value(after, fam, model=MODEL, **{cat: v})  # noqa: E731
    slots = g("nv_trt_llm_request_metrics", "request_type", "max")
    assert slots >= 1 and g("nv_trt_llm_request_metrics", "request_type", "waiting") == 0
    kv = "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type"
    # the paged cache's blocks of 16: at most every slot at max_seq_len (+ K + 1 positions), fewer where memory is short
    assert g(*kv, "tokens_per") == 16 and 0 < g(*kv, "max") <= slots * -(-(max_seq_len + 16) // 16)
    assert g(*kv, "used") == 0 and g(*kv, "free") == g(*kv, "max") and g(*kv, "fraction") == 0
    assert counted(after) >= steps
    assert g("nv_trt_llm_general_metrics", "general_type", "timestamp") > 0
    assert g("nv_trt_llm_runtime_memory_metrics", "memory_type", "cpu") > 100e6  # the engine process's RSS
    assert g("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric", "paused_requests") == 0


def test_the_trtllm_gauges_show_a_running_request(server):
    """While one request decodes: one slot active and scheduled, its KV blocks held."""
    client = grpcclient.InferenceServerClient(server.grpc)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = {"text_input": one(PROMPT.encode(), np.object_), "max_tokens": one(1500, np.int32),
              "min_tokens": one(1500, np.int32), "stream": one(True, np.bool_)}
    try:
        client.async_stream_infer(MODEL, tensor_inputs(inputs), request_id="long-one")
        result, error = q.get(timeout=300)
        assert error is None
        assert server.wait_metric("nv_trt_llm_request_metrics", 1.0, timeout=60, request_type="active") == 1.0
        kv = lambda text, v: value(text, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=v)  # noqa: E731
        for _ in range(50):  # the gauges are set one by one: a scrape may fall between two of them
            text = server.metrics_text()
            used, total, free = kv(text, "used"), kv(text, "max"), kv(text, "free")
            # (the fraction as the metrics text prints it: to its digits)
            if used >= 1 and free == total - used and abs(kv(text, "fraction") - used / total) <= 1e-4 * used / total:
                break
        else:
            raise AssertionError(f"used {used}, free {free}, max {total}")
        assert value(text, "nv_trt_llm_request_metrics", request_type="max") >= 1
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert server.wait_metric("nv_trt_llm_request_metrics", 0.0, timeout=60, request_type="active") == 0.0
