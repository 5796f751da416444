"""Several engines in one server: `instance_group { count: 2 kind: KIND_CPU }` on the engine model.

Against a real tritonserver serving a copy of the model repository whose `specguide` model has two
instances: each instance is a Python backend stub with an engine process of its own, its own slots
(`nv_trt_llm_request_metrics{request_type="max"}` per instance) and its own compile workers, and
nothing process-wide is shared (shared-memory regions, processes). Concurrent traffic through the
two proxies (BLS requests to `specguide`) and to `specguide` itself is served by both instances:
Triton's statistics are per model, so the per-instance view is the `model_instance` label of the
`specguide_*` metrics (Triton's instance names: `specguide_0_0`, `specguide_0_1`).
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from specguide.process.supervisor import descendants, stubs

from .conftest import MODEL, Server, launch, repository_with, stop_and_check
from .helpers import B, I, S, raw_stream, tensor_inputs

INSTANCES = ("specguide_0_0", "specguide_0_1")
SLOTS = 2
PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
ROUNDS = 4  # rounds of concurrent requests (each: two per name)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("instances")
    repo = repository_with(root, {"max_slots": str(SLOTS)})
    cfg = repo / MODEL / "config.pbtxt"
    text = cfg.read_text()
    group = "count: 1\n    kind: KIND_MODEL"
    assert text.count(group) == 1
    cfg.write_text(text.replace(group, "count: 2\n    kind: KIND_CPU"))
    srv = launch(root / "server.log", repo)
    yield srv
    stop_and_check(srv)


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def engines(srv: Server) -> dict[int, list[int]]:
    """Each engine model stub's pid -> [its engine process, that engine's compile workers]."""
    out = {}
    for stub in stubs(srv.proc.pid)[MODEL]:
        engine = [p for p in descendants(stub) if b"engine_process" in cmdline(p)]
        assert len(engine) == 1, (stub, engine)
        workers = [p for p in descendants(engine[0]) if b"compile_worker" in cmdline(p)]
        out[stub] = engine + workers
    return out


def served(srv: Server) -> Counter:
    """Sequences each instance finished (any reason), from the model_instance label."""
    return Counter({i: sum(srv.metric("specguide_requests_total", model=MODEL, model_instance=i, finish_reason=r)
                           for r in ("stop", "length")) for i in INSTANCES})


def test_two_instances_are_two_engines_with_their_own_slots_and_workers(two):
    found = engines(two)
    assert len(found) == 2
    (a, b) = found.values()
    assert a[0] != b[0] and len(a) > 1 and len(b) > 1 and not set(a) & set(b)  # engine + its own workers
    # each stub has a shared-memory region of its own (argv[2] of the stub)
    regions = {cmdline(stub).split(b"\0")[2] for stub in found}
    assert len(regions) == 2
    for instance in INSTANCES:  # each engine reports its own slots, in series of its own
        assert two.wait_metric("nv_trt_llm_request_metrics", SLOTS, model=MODEL, model_instance=instance,
                               request_type="max") == SLOTS
        assert two.metric("specguide_engine_alive", model=MODEL, model_instance=instance) == 1.0


def test_concurrent_traffic_through_the_proxies_reaches_both_instances(two):
    before = served(two)
    errors: list[str] = []

    def vllm() -> None:
        inputs = {"text_input": np.array([PROMPT.encode()], np.object_), "stream": np.array([True]),
                  "sampling_parameters": np.array([json.dumps({"max_tokens": 24}).encode()], np.object_)}
        got = raw_stream(two, inputs, model="specguide_vllm")
        errors.extend(str(e) for _, e, _ in got if e is not None)

    def unary() -> None:
        client = grpcclient.InferenceServerClient(two.grpc)
        try:
            client.infer("specguide_unary", tensor_inputs({"text_input": S(PROMPT), "max_tokens": I(24)}))
        except grpcclient.InferenceServerException as e:
            errors.append(e.message())
        client.close()

    def direct() -> None:
        got = raw_stream(two, {"text_input": S(PROMPT), "max_tokens": I(24), "stream": B(True)})
        errors.extend(str(e) for _, e, _ in got if e is not None)

    for _ in range(ROUNDS):
        threads = [threading.Thread(target=f) for f in (vllm, vllm, unary, unary)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
    proxied = served(two) - before
    # every proxied request was served, and by both engines
    print(f"proxied requests served per instance: {dict(proxied)}")
    assert sum(proxied.values()) == ROUNDS * 4 and all(proxied[i] > 0 for i in INSTANCES), proxied
    threads = [threading.Thread(target=direct) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sum((served(two) - before).values()) == ROUNDS * 4 + 4


def finished(srv: Server, reason: str) -> float:
    return sum(srv.metric("specguide_requests_total", model=MODEL, model_instance=i, finish_reason=reason)
               for i in INSTANCES)


def test_a_stop_request_stops_the_request_on_whichever_instance_runs_it(two):
    """TensorRT-LLM's stop request (the running request's id, `stop` true) reaches whichever
    instance Triton picks, as does the one the vLLM proxy sends when its client cancels; the
    instance running the request stops it either way (stop_board.py): every such request ends
    `cancelled` (the TensorRT-LLM interface: a CANCELLED error), none runs to its max_tokens."""
    cancelled, lengths = finished(two, "cancelled"), finished(two, "length")
    long = {"text_input": S(PROMPT), "max_tokens": I(1500), "min_tokens": I(1500), "stream": B(True)}
    for k in range(4):  # direct: the request on one stream, its stop on another (as a second client would)
        rid = f"stop-me-{k}"
        client, stopper = grpcclient.InferenceServerClient(two.grpc), grpcclient.InferenceServerClient(two.grpc)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(MODEL, tensor_inputs(long), request_id=rid, enable_empty_final_response=True)
        result, error = got.get(timeout=120)  # it runs
        assert error is None, error
        stopper.start_stream(callback=lambda result, error: None)
        stopper.async_stream_infer(MODEL, tensor_inputs({"stop": B(True)}), request_id=rid,
                                   enable_empty_final_response=True)
        while True:  # its responses until the last: the error a stopped request ends with
            result, error = got.get(timeout=300)
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert error is not None and error.message() == "request was cancelled", error or result
        for c in (client, stopper):
            c.stop_stream()
            c.close()
    vllm = {"text_input": np.array([PROMPT.encode()], np.object_), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps({"max_tokens": 1500, "min_tokens": 1500}).encode()],
                                            np.object_)}
    for _ in range(4):  # through the proxy: its client goes away after the first response
        raw_stream(two, vllm, cancel_after=1, model="specguide_vllm")
    deadline = time.monotonic() + 120
    while finished(two, "cancelled") - cancelled < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (finished(two, "cancelled") - cancelled, finished(two, "length") - lengths) == (8, 0)
