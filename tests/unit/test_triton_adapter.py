"""specguide.triton.adapter (TritonPythonModel) with a fake Triton module and a fake engine: responses,
FINAL flags, errors, cancellation, stop requests, metrics (no server needed)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from specguide.request import QueueFullError, RequestOutput
from specguide.triton import request_parser
from specguide.triton.interfaces import INTERFACE_PARAMETER
from specguide.triton.request_inputs import CLIENT_PARAMETERS
from specguide.triton.responses import event_error_code
from triton_fakes import TOK, FakeRequest, FakeTritonError, pb, s


# ---------------------------------------------------------------------------------- fakes


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

        import dataclasses

        # as the engine resolves it: max_seq_len 0 is the model's context (2,048 for this fake model)
        config = dataclasses.replace(config, max_seq_len=config.max_seq_len or 2048)
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


# ---------------------------------------------------------------------------------- responses, errors, cancellation


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
