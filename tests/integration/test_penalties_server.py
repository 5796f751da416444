"""Sampling penalties through the real tritonserver: a TensorRT-LLM `repetition_penalty` FP32 tensor
over gRPC changes a greedy output, the vLLM key does the same, and the server stays healthy."""
from __future__ import annotations

import json
import urllib.request

import numpy as np

from .helpers import B, I, S, raw_stream

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy continues the count, reusing the prompt's tokens
MAX_TOKENS = 16


def greedy_ids(server, **extra: np.ndarray) -> list[int]:
    got = raw_stream(server, {"text_input": S(PROMPT), "max_tokens": I(MAX_TOKENS), "stream": B(True), **extra})
    assert all(err is None for _, err, _ in got), [err.message() for _, err, _ in got if err is not None]
    assert got[-1][2] and got[-1][0].as_numpy("finish_reason")[0, 0] in (b"stop", b"length")
    return [int(t) for r, _, _ in got for t in r.as_numpy("output_ids").reshape(-1)]


def test_repetition_penalty_changes_greedy_output_and_the_server_stays_healthy(server):
    errors = server.metric("specguide_requests_total", finish_reason="error")
    rejected = server.metric("specguide_requests_total", finish_reason="rejected")
    plain = greedy_ids(server)
    penalized = greedy_ids(server, repetition_penalty=I(1.5, np.float32))
    assert plain and penalized
    assert penalized != plain, "repetition_penalty 1.5 left the greedy output unchanged"
    # the vLLM key gives the same (greedy, deterministic) output as the tensor
    vllm = json.dumps({"max_tokens": MAX_TOKENS, "temperature": 0, "repetition_penalty": 1.5})
    assert greedy_ids(server, sampling_parameters=S(vllm)) == penalized
    # the penalty state does not leak into the slot: the plain request is unchanged afterwards
    assert greedy_ids(server) == plain
    with urllib.request.urlopen(f"http://{server.http}/v2/health/ready", timeout=10) as r:
        assert r.status == 200
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
    assert server.metric("specguide_requests_total", finish_reason="error") == errors
    assert server.metric("specguide_requests_total", finish_reason="rejected") == rejected
