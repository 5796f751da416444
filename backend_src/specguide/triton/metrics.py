"""Custom metrics on Triton's metrics port (`/metrics`), through `pb_utils.MetricFamily`.

    specguide_requests_total{finish_reason}        sequences finished (stop|length|timeout|cancelled|error|rejected)
    specguide_cancellations_total{stage}           cancelled sequences by where they were (queued|compiling|prefill|decode)
    specguide_engine_alive                         gauge: 1 while the engine serves, 0 while it is down (restarting)
    specguide_engine_restarts_total                engine processes started again after the last one died
    specguide_draft_head_loaded                    gauge: 1 once the trained draft head drafts ("head" / "hybrid"),
                                                   0 while the engine drafts without it (it trains in the background)
    specguide_server_restarts_total                tritonserver restarts by specguide.process.supervisor (a stub died)
    specguide_prompt_tokens_total                  prompt tokens of admitted sequences
    specguide_generation_tokens_total              generated tokens
    specguide_prefix_cache_query_tokens_total      prompt tokens looked up in the prefix cache (prefix_caching on)
    specguide_prefix_cache_hit_tokens_total        of those, tokens whose KV was reused, not computed
    specguide_time_to_first_token_seconds          histogram: arrival -> first generated token
    specguide_time_per_output_token_seconds        histogram: gap between responses / tokens in the later one
    specguide_request_latency_seconds              histogram: arrival -> last response
    specguide_active_slots                         gauge: sequences in the running batch
    specguide_queue_depth                          gauge: sequences waiting for a slot
    specguide_kv_blocks_used                       gauge: KV blocks (16 positions) the running sequences hold (a shared one once)
    specguide_kv_blocks_free                       gauge: KV blocks no running sequence holds
    specguide_preempted_sequences                  gauge: running sequences waiting for blocks to be recomputed
    specguide_preemptions_total                    sequences preempted because KV blocks ran short
    specguide_draft_tokens_total                   speculative draft tokens proposed
    specguide_accepted_draft_tokens_total          speculative draft tokens accepted
    specguide_tokens_per_step                      histogram: tokens a sequence gains per decode step
                                                   (accepted drafts + 1; 1 without speculation)
    specguide_lora_requests_total{adapter}         sequences that ran with a LoRA adapter (its name, or
                                                   `task N` for a TensorRT-LLM task), ended without error
    specguide_lora_generation_tokens_total{adapter}  tokens they generated
    specguide_lora_adapters_resident               gauge: adapters in memory (at most max_loras)
    specguide_lora_adapter_loads_total             adapters made resident (each time one takes a place)

Every metric carries the labels `model`, `version` and `model_instance`: the Triton instance
whose engine it describes (`instance.Instance.label`, e.g. `specguide_0_1`), so several instances of
the model in one server (config.pbtxt `instance_group` count > 1, one engine each) keep their
gauges apart and show which engine served. Sum over `model_instance` for the model.
`specguide_server_restarts_total` is the server's count, the same in every instance (take the max).
`pb` is triton_python_backend_utils.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..process.restarts import RESTARTS_ENV

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "error", "rejected")
CANCEL_STAGES = ("queued", "compiling", "prefill", "decode")
STEP_BUCKETS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0]
MAX_ADAPTER_LABELS = 256  # adapters with series of their own; later ones count under "other"


class Metrics:
    def __init__(self, pb: Any, model: str, version: str, instance: str = ""):
        labels = {"model": model, "version": str(version), "model_instance": instance or f"{model}_0_0"}
        MF = pb.MetricFamily

        def family(name, doc, kind):
            return MF(name=name, description=doc, kind=kind)

        self._families = []  # keep families alive as long as their metrics
        self._set: dict[str, float] = {}  # the engine gauges' last values set (engine_stats)

        def counter(name, doc, **extra):
            f = family(name, doc, MF.COUNTER)
            self._families.append(f)
            return f.Metric(labels={**labels, **extra})

        def gauge(name, doc):
            f = family(name, doc, MF.GAUGE)
            self._families.append(f)
            return f.Metric(labels=labels)

        def histogram(name, doc, buckets):
            f = family(name, doc, MF.HISTOGRAM)
            self._families.append(f)
            return f.Metric(labels=labels, buckets=buckets)

        req = family("specguide_requests_total", "Sequences finished, by finish reason", MF.COUNTER)
        self._families.append(req)
        self.requests = {r: req.Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
        self.prompt_tokens = counter("specguide_prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = counter("specguide_generation_tokens_total", "Tokens generated")
        self.prefix_query_tokens = counter("specguide_prefix_cache_query_tokens_total",
                                           "Prompt tokens looked up in the prefix cache")
        self.prefix_hit_tokens = counter("specguide_prefix_cache_hit_tokens_total",
                                         "Prompt tokens whose KV came from the prefix cache")
        self.ttft = histogram("specguide_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token", TTFT_BUCKETS)
        self.tpot = histogram("specguide_time_per_output_token_seconds",
                              "Gap between consecutive responses divided by the tokens in the later one", TPOT_BUCKETS)
        self.latency = histogram("specguide_request_latency_seconds",
                                 "Time from request arrival to its last response", LATENCY_BUCKETS)
        self.active_slots = gauge("specguide_active_slots", "Sequences in the running batch")
        self.queue_depth = gauge("specguide_queue_depth", "Sequences waiting for a slot")
        self.kv_used = gauge("specguide_kv_blocks_used", "KV blocks (16 positions each) the running sequences hold")
        self.kv_free = gauge("specguide_kv_blocks_free", "KV blocks no running sequence holds (cached prefix "
                                                         "blocks count: they are taken last)")
        self.preempted = gauge("specguide_preempted_sequences",
                               "Running sequences that gave their KV blocks back, waiting to be recomputed")
        self.preemptions = counter("specguide_preemptions_total", "Sequences preempted because KV blocks ran short")
        self._preemptions = 0.0  # the engine's count at the last poll (a restarted engine counts from 0)
        self.draft_tokens = counter("specguide_draft_tokens_total", "Speculative draft tokens proposed")
        self.accepted_tokens = counter("specguide_accepted_draft_tokens_total", "Speculative draft tokens accepted")
        self.engine_alive = gauge("specguide_engine_alive", "1 while the engine serves; 0 while it is down (restarting)")
        self.engine_alive.set(1.0)
        self._set["alive"] = 1.0
        self.draft_head = gauge("specguide_draft_head_loaded",
                                "1 once the trained draft head drafts; 0 while the engine drafts without it")
        self.engine_restarts = counter("specguide_engine_restarts_total",
                                       "Engine processes started again after the last one died")
        self.server_restarts = counter("specguide_server_restarts_total",
                                       "tritonserver restarts by specguide.process.supervisor after a Python backend stub died")
        self.server_restarts.increment(float(os.environ.get(RESTARTS_ENV, "0") or 0))
        canc = family("specguide_cancellations_total", "Cancelled sequences, by the stage they were in", MF.COUNTER)
        self._families.append(canc)
        self.cancellations = {s: canc.Metric(labels={**labels, "stage": s}) for s in CANCEL_STAGES}
        self.tokens_per_step = histogram("specguide_tokens_per_step",
                                         "Tokens a sequence gains per decode step (accepted drafts + 1)", STEP_BUCKETS)
        self._labels, self._family, self._counter = labels, family, MF.COUNTER
        self._lora_families: Optional[tuple[Any, Any]] = None  # made when the first adapter's sequence ends
        self._per_adapter: dict[str, tuple[Any, Any]] = {}
        self.lora_resident = gauge("specguide_lora_adapters_resident", "LoRA adapters in memory (at most max_loras)")
        self.lora_loads = counter("specguide_lora_adapter_loads_total", "LoRA adapters made resident")
        self._lora_loads = 0.0

    def finished(self, reason: str) -> None:
        self.requests.get(reason if reason in self.requests else "error").increment(1)

    def cancelled(self, stage: str) -> None:
        m = self.cancellations.get(stage)
        if m is not None:
            m.increment(1)

    def adapter_finished(self, adapter: str, tokens: int) -> None:
        """A sequence that ran with `adapter` ended (without error), having generated `tokens`."""
        if self._lora_families is None:
            self._lora_families = (
                self._family("specguide_lora_requests_total",
                             "Sequences that ran with a LoRA adapter and ended without error", self._counter),
                self._family("specguide_lora_generation_tokens_total", "Tokens generated with a LoRA adapter",
                             self._counter))
            self._families += list(self._lora_families)
        if adapter not in self._per_adapter:
            if len(self._per_adapter) >= MAX_ADAPTER_LABELS:
                adapter = "other"
            if adapter not in self._per_adapter:
                labels = {**self._labels, "adapter": adapter}
                self._per_adapter[adapter] = tuple(f.Metric(labels=labels) for f in self._lora_families)
        requests, generated = self._per_adapter[adapter]
        requests.increment(1)
        generated.increment(float(tokens))

    def engine_stats(self, stats: dict) -> None:
        """Set the gauges whose values changed (each set is a message to the server, every poll)."""
        n = float(stats.get("preemptions", self._preemptions))
        if n != self._preemptions:
            self.preemptions.increment(n - self._preemptions if n > self._preemptions else n)
            self._preemptions = n
        n = float(stats.get("lora_adapter_loads", self._lora_loads))
        if n != self._lora_loads:  # (a restarted engine counts from 0)
            self.lora_loads.increment(n - self._lora_loads if n > self._lora_loads else n)
            self._lora_loads = n
        for gauge, key, default in ((self.active_slots, "active_slots", 0), (self.queue_depth, "queue_depth", 0),
                                    (self.engine_alive, "alive", 1), (self.draft_head, "draft_head", 0),
                                    (self.kv_used, "kv_blocks_used", 0), (self.kv_free, "kv_blocks_free", 0),
                                    (self.preempted, "preempted", 0),
                                    (self.lora_resident, "lora_adapters_resident", 0)):
            value = float(stats.get(key, default))
            if self._set.get(key) != value:
                gauge.set(value)
                self._set[key] = value
