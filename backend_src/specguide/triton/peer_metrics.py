"""The metric families the vLLM and TensorRT-LLM Triton backends export, filled from this engine.

Names, kinds, descriptions, label names and buckets are those of the backends' own sources, so a
fleet's dashboards, alerts and autoscalers keep working. Matched against:

- vLLM backend: triton-inference-server/vllm_backend `src/utils/metrics.py` at main 8de0c148
  (the same families since r25.01), plus `vllm:request_params_best_of` of r24.09-r24.12
  (r24.10 = b71088af, the release of our tritonserver 2.51). vLLM v1's stat semantics (what main's
  logger reads: `IterationStats`, `FinishedRequestStats`). No version of that backend exports
  vLLM's gauges (`vllm:num_requests_running`, ...) or `vllm:request_success_total`.
- TensorRT-LLM backend: NVIDIA/TensorRT-LLM `triton_backend/inflight_batcher_llm/src/
  custom_metrics_reporter/custom_metrics_reporter.cc` at 0d5352f5 and the values its
  `model_instance_state.cc` (0c8de69a, `WaitForStats`, `reportCustomMetrics`) puts in them: the C++
  `tensorrtllm` backend. (triton-inference-server/tensorrtllm_backend r24.10, af89ec75, has a subset:
  no `waiting`, `fraction`, disaggregated-serving or token-length families.)

Labels: every family carries `model` and `version`, as both backends label theirs. Per-request
families (all `vllm:*`, `nv_llm_input_token_len`, `nv_llm_output_token_len`) get one series per
served model the traffic came through (`specguide`, `specguide_unary`, `specguide_vllm`), so a vLLM
dashboard on `model="specguide_vllm"` sees that model's traffic. The engine's state families
(`nv_trt_llm_*`) describe the one engine every name shares and are labelled with the model that
hosts it (`specguide`), as TensorRT-LLM labels them with `tensorrt_llm`, not with the `ensemble`
its clients call. With several instances of the engine model in one server (`instance_group`
count > 1: one engine each), the state families also carry `model_instance` (the instance whose
engine they describe), else the engines would overwrite each other's gauges; the per-request
families stay shared by the instances (Triton adds up the increments of series with equal labels).
`pb` is triton_python_backend_utils (a fake one in the unit tests).
"""
from __future__ import annotations

import threading
from typing import Any

# ---- vLLM backend (src/utils/metrics.py) -------------------------------------------------------
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
VLLM_E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]

# ---- TensorRT-LLM backend (custom_metrics_reporter.cc) ------------------------------------------
TRTLLM_TOKEN_LEN_BUCKETS = [10.0, 50.0, 100.0, 500.0, 1000.0]
# family -> (description, category label, label values in the reporter's order)
TRTLLM_GAUGES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                   ("active", "max", "scheduled", "context", "waiting")),
    "nv_trt_llm_runtime_memory_metrics": ("TRT LLM runtime memory metrics", "memory_type", ("cpu", "gpu", "pinned")),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type",
                                          ("max", "free", "used", "tokens_per", "reused", "fraction")),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight_batcher-specific metrics",
                                            "inflight_batcher_specific_metric",
                                            ("total_context_tokens", "generation_requests", "micro_batch_id",
                                             "paused_requests")),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type", ("timestamp", "iteration_counter")),
}
# a counter family there (aggregated request statistics of disaggregated serving): always 0 here
TRTLLM_DISAGG = ("nv_trt_llm_disaggregated_serving_metrics", "TRT LLM disaggregated serving metrics",
                 "disaggregated_serving_type", ("kv_cache_transfer_ms", "request_count"))
MAX_SERVED = 16  # series sets for names other than the repository's three (a renamed proxy); then the default


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to max_value (request token histograms)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def trtllm_values(stats: dict[str, int]) -> dict[str, dict[str, float]]:
    """The TensorRT-LLM gauges' values from the engine's `stats()` (engine.Engine.stats), by family
    and label value. Semantics as `WaitForStats` fills them from the executor's IterationStats:
    active = requests holding a slot (numActiveRequests), max = slots (maxNumActiveRequests),
    scheduled / context / generation_requests / total_context_tokens = the latest iteration's,
    waiting = active - scheduled, timestamp = the latest iteration's wall clock in microseconds."""
    g = lambda k: float(stats.get(k, 0) or 0)  # noqa: E731
    active, scheduled = g("active_slots"), g("context_requests") + g("generation_requests")
    kv_max, kv_used = g("kv_blocks_max"), g("kv_blocks_used")
    return {
        "nv_trt_llm_request_metrics": {
            "active": active, "max": g("max_slots"), "scheduled": scheduled,
            "context": g("context_requests"), "waiting": max(0.0, active - scheduled)},
        "nv_trt_llm_runtime_memory_metrics": {
            "cpu": g("cpu_mem_bytes"), "gpu": g("gpu_mem_bytes"), "pinned": g("pinned_mem_bytes")},
        "nv_trt_llm_kv_cache_block_metrics": {
            "max": kv_max, "free": max(0.0, kv_max - kv_used), "used": kv_used,
            "tokens_per": g("kv_tokens_per_block"), "reused": g("kv_blocks_reused"),
            "fraction": kv_used / kv_max if kv_max > 0 else 0.0},
        "nv_trt_llm_inflight_batcher_metrics": {
            "total_context_tokens": g("context_tokens"), "generation_requests": g("generation_requests"),
            "micro_batch_id": 0.0, "paused_requests": 0.0},  # no pipeline parallelism; nothing is ever paused
        "nv_trt_llm_general_metrics": {"timestamp": g("step_time_us"), "iteration_counter": g("steps")},
    }


class Served:
    """The per-request series of one served model (name, version)."""

    def __init__(self, fam: dict[str, Any], labels: dict[str, str], max_model_len: int):
        def metric(name: str, **kw: Any) -> Any:
            return fam[name].Metric(labels=labels, **kw)

        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = metric("vllm:prompt_tokens_total")
        self.generation_tokens = metric("vllm:generation_tokens_total")
        self.ttft = metric("vllm:time_to_first_token_seconds", buckets=VLLM_TTFT_BUCKETS)
        self.tpot = metric("vllm:time_per_output_token_seconds", buckets=VLLM_TPOT_BUCKETS)
        self.e2e = metric("vllm:e2e_request_latency_seconds", buckets=VLLM_E2E_BUCKETS)
        self.request_prompt_tokens = metric("vllm:request_prompt_tokens", buckets=tokens)
        self.request_generation_tokens = metric("vllm:request_generation_tokens", buckets=tokens)
        self.n = metric("vllm:request_params_n", buckets=VLLM_N_BUCKETS)
        self.best_of = metric("vllm:request_params_best_of", buckets=VLLM_N_BUCKETS)
        self.input_len = fam["nv_llm_input_token_len"].Metric(
            labels={**labels, "response_metric_type": "total_input_tokens"}, buckets=TRTLLM_TOKEN_LEN_BUCKETS)
        self.output_len = fam["nv_llm_output_token_len"].Metric(
            labels={**labels, "response_metric_type": "total_output_tokens"}, buckets=TRTLLM_TOKEN_LEN_BUCKETS)

    # one engine sequence's events, as vLLM v1 counts a request's (one sequence = one vLLM request)
    def first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        """The prefill's first token: vLLM adds the prompt's length when prefill completes."""
        self.prompt_tokens.increment(float(prompt_tokens))
        self.ttft.observe(ttft_s)

    def tokens(self, n: int, since_last_s: float | None) -> None:
        """n new tokens in one engine step; `since_last_s` is the gap since the sequence's previous
        step (None for the first): vLLM v1's inter-token latency, one observation per step."""
        self.generation_tokens.increment(float(n))
        if since_last_s is not None:
            self.tpot.observe(since_last_s)

    def finished(self, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(float(prompt_tokens))
        self.request_generation_tokens.observe(float(generation_tokens))
        self.input_len.observe(float(prompt_tokens))
        self.output_len.observe(float(generation_tokens))

    def row(self, n: int) -> None:
        """One prompt's sampling parameters: n sequences (best_of is n: only its neutral value is taken)."""
        self.n.observe(float(n))
        self.best_of.observe(float(n))


class PeerMetrics:
    def __init__(self, pb: Any, engine_model: str, version: str, max_model_len: int,
                 served: tuple[tuple[str, str], ...] = (), instance: str = ""):
        """`instance`: the `model_instance` label of the engine-state families ("" = none: one engine
        in the server, labelled exactly as TensorRT-LLM labels its own)."""
        MF = pb.MetricFamily
        self._max_model_len = max_model_len
        self._fam: dict[str, Any] = {}  # families live as long as their metrics

        def family(name: str, doc: str, kind: Any) -> None:
            self._fam[name] = MF(name=name, description=doc, kind=kind)

        family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", MF.COUNTER)
        family("vllm:generation_tokens_total", "Number of generation tokens processed.", MF.COUNTER)
        family("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", MF.HISTOGRAM)
        family("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", MF.HISTOGRAM)
        family("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
               MF.HISTOGRAM)
        family("vllm:request_prompt_tokens", "Number of prefill tokens processed.", MF.HISTOGRAM)
        family("vllm:request_generation_tokens", "Number of generation tokens processed.", MF.HISTOGRAM)
        family("vllm:request_params_n", "Histogram of the n request parameter.", MF.HISTOGRAM)
        family("vllm:request_params_best_of", "Histogram of the best_of request parameter.", MF.HISTOGRAM)
        family("nv_llm_input_token_len", "TRT LLM response metrics", MF.HISTOGRAM)
        family("nv_llm_output_token_len", "TRT LLM response metrics", MF.HISTOGRAM)
        common = {"model": engine_model, "version": str(version), **({"model_instance": instance} if instance else {})}
        self._gauges: dict[str, dict[str, Any]] = {}
        for name, (doc, category, values) in TRTLLM_GAUGES.items():
            family(name, doc, MF.GAUGE)
            self._gauges[name] = {v: self._fam[name].Metric(labels={**common, category: v}) for v in values}
        name, doc, category, values = TRTLLM_DISAGG
        family(name, doc, MF.COUNTER)
        self._disagg = [self._fam[name].Metric(labels={**common, category: v}) for v in values]
        self._set: dict[tuple[str, str], float] = {}  # gauge values already sent to the server
        self._lock = threading.Lock()
        self._served: dict[tuple[str, str], Served] = {}
        self.default = self.served(engine_model, str(version))
        for model, ver in served:
            self.served(model, ver)
        self._fixed = len(self._served)

    def served(self, model: str, version: str) -> Served:
        """The series of a served model, made on its first request; past MAX_SERVED other names
        (a client naming models that do not exist), the engine model's."""
        key = (str(model), str(version))
        with self._lock:
            s = self._served.get(key)
            if s is None:
                if len(self._served) >= getattr(self, "_fixed", 0) + MAX_SERVED:
                    return self.default
                s = self._served[key] = Served(self._fam, {"model": key[0], "version": key[1]}, self._max_model_len)
            return s

    def engine_stats(self, stats: dict[str, int]) -> None:
        """Set the gauges that changed (each set is a message to the server: ~20 a poll otherwise)."""
        for name, values in trtllm_values(stats).items():
            for label, value in values.items():
                if self._set.get((name, label)) != value:
                    self._gauges[name][label].set(value)
                    self._set[(name, label)] = value
