"""specguide.triton.peer_metrics: the vLLM and TensorRT-LLM backends' metric families, their
names, kinds, labels and buckets, and the mapping from the engine's stats (no server needed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specguide.triton import peer_metrics as pm


class Metric:
    def __init__(self, family, labels, buckets):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value, self.observed, self.sets = 0.0, [], 0

    def increment(self, v):
        assert self.family.kind == "counter"
        self.value += v

    def set(self, v):
        assert self.family.kind == "gauge"
        self.value, self.sets = v, self.sets + 1

    def observe(self, v):
        assert self.family.kind == "histogram" and self.buckets is not None
        self.observed.append(v)


class Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        assert name not in registry, f"family {name} registered twice"
        self.name, self.description, self.kind, self.metrics = name, description, kind, []
        registry[name] = self

    def Metric(self, labels, buckets=None):
        m = Metric(self, dict(labels), buckets)
        self.metrics.append(m)
        return m


registry: dict[str, Family] = {}


@pytest.fixture
def metrics():
    registry.clear()
    yield pm.PeerMetrics(SimpleNamespace(MetricFamily=Family), "specguide", "1", max_model_len=2048,
                         served=(("specguide_unary", "1"), ("specguide_vllm", "1")))
    registry.clear()


def series(name, **labels):
    got = [m for m in registry[name].metrics if all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (name, labels, [m.labels for m in registry[name].metrics])
    return got[0]


# what the backends' sources declare (peer_metrics' docstring names the commits)
VLLM = {
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    "vllm:time_per_output_token_seconds": ("histogram", "Histogram of time per output token in seconds."),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of end to end request latency in seconds."),
    "vllm:request_prompt_tokens": ("histogram", "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("histogram", "Number of generation tokens processed."),
    "vllm:request_params_n": ("histogram", "Histogram of the n request parameter."),
    "vllm:request_params_best_of": ("histogram", "Histogram of the best_of request parameter."),
}
TRTLLM = {  # family: (kind, category label, label values)
    "nv_trt_llm_request_metrics": ("gauge", "request_type", {"active", "max", "scheduled", "context", "waiting"}),
    "nv_trt_llm_runtime_memory_metrics": ("gauge", "memory_type", {"cpu", "gpu", "pinned"}),
    "nv_trt_llm_kv_cache_block_metrics": ("gauge", "kv_cache_block_type",
                                          {"max", "free", "used", "tokens_per", "reused", "fraction"}),
    "nv_trt_llm_inflight_batcher_metrics": ("gauge", "inflight_batcher_specific_metric",
                                            {"total_context_tokens", "generation_requests", "micro_batch_id",
                                             "paused_requests"}),
    "nv_trt_llm_general_metrics": ("gauge", "general_type", {"timestamp", "iteration_counter"}),
    "nv_trt_llm_disaggregated_serving_metrics": ("counter", "disaggregated_serving_type",
                                                 {"kv_cache_transfer_ms", "request_count"}),
    "nv_llm_input_token_len": ("histogram", "response_metric_type", {"total_input_tokens"}),
    "nv_llm_output_token_len": ("histogram", "response_metric_type", {"total_output_tokens"}),
}


def test_build_1_2_5_buckets_is_vllms():
    assert pm.build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert pm.build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert pm.build_1_2_5_buckets(1) == [1]


def test_every_family_with_its_kind_description_and_labels(metrics):
    assert set(registry) == set(VLLM) | set(TRTLLM)
    for name, (kind, doc) in VLLM.items():
        fam = registry[name]
        assert (fam.kind, fam.description) == (kind, doc)
        # one series per served model, labelled as the vLLM backend labels: model and version only
        assert sorted((m.labels["model"], m.labels["version"]) for m in fam.metrics) == \
            [("specguide", "1"), ("specguide_unary", "1"), ("specguide_vllm", "1")]
        assert all(set(m.labels) == {"model", "version"} for m in fam.metrics)
    for name, (kind, category, values) in TRTLLM.items():
        fam = registry[name]
        assert fam.kind == kind, name
        assert all(set(m.labels) == {"model", "version", category} for m in fam.metrics), name
        assert {m.labels[category] for m in fam.metrics} == values, name
    # the engine's state: one series each, labelled with the model hosting the engine
    assert {m.labels["model"] for m in registry["nv_trt_llm_kv_cache_block_metrics"].metrics} == {"specguide"}
    assert {m.labels["model"] for m in registry["nv_llm_input_token_len"].metrics} == \
        {"specguide", "specguide_unary", "specguide_vllm"}


def test_buckets_are_the_backends(metrics):
    assert series("vllm:time_to_first_token_seconds", model="specguide_vllm").buckets == pm.VLLM_TTFT_BUCKETS
    assert pm.VLLM_TTFT_BUCKETS[:3] == [0.001, 0.005, 0.01] and pm.VLLM_TTFT_BUCKETS[-1] == 10.0
    assert series("vllm:time_per_output_token_seconds", model="specguide").buckets[-1] == 2.5
    assert series("vllm:e2e_request_latency_seconds", model="specguide").buckets == \
        [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert series("vllm:request_prompt_tokens", model="specguide").buckets == pm.build_1_2_5_buckets(2048)
    assert series("vllm:request_params_n", model="specguide").buckets == [1, 2, 5, 10, 20]
    assert series("nv_llm_output_token_len", model="specguide").buckets == [10.0, 50.0, 100.0, 500.0, 1000.0]


def test_a_sequence_is_counted_as_vllm_counts_a_request(metrics):
    s = metrics.served("specguide_vllm", "1")
    s.first_token(7, 0.25)
    s.tokens(1, None)  # the prefill's token
    s.tokens(3, 0.04)  # a speculative step: 3 tokens, one inter-token latency
    s.finished(7, 4, 0.5)
    s.row(1)
    assert series("vllm:prompt_tokens_total", model="specguide_vllm").value == 7
    assert series("vllm:generation_tokens_total", model="specguide_vllm").value == 4
    assert series("vllm:time_to_first_token_seconds", model="specguide_vllm").observed == [0.25]
    assert series("vllm:time_per_output_token_seconds", model="specguide_vllm").observed == [0.04]
    assert series("vllm:e2e_request_latency_seconds", model="specguide_vllm").observed == [0.5]
    assert series("vllm:request_prompt_tokens", model="specguide_vllm").observed == [7]
    assert series("vllm:request_generation_tokens", model="specguide_vllm").observed == [4]
    assert series("vllm:request_params_n", model="specguide_vllm").observed == [1]
    assert series("nv_llm_input_token_len", model="specguide_vllm").observed == [7]
    assert series("nv_llm_output_token_len", model="specguide_vllm").observed == [4]
    assert series("vllm:prompt_tokens_total", model="specguide").value == 0  # other names untouched


def test_served_names_are_made_on_first_use_and_bounded(metrics):
    renamed = metrics.served("my_vllm", "2")
    assert renamed is metrics.served("my_vllm", "2")
    assert series("vllm:prompt_tokens_total", model="my_vllm", version="2") is renamed.prompt_tokens
    for i in range(pm.MAX_SERVED + 5):
        metrics.served(f"name{i}", "1")
    assert metrics.served("one_too_many", "1") is metrics.default
    assert len(registry["vllm:prompt_tokens_total"].metrics) == 3 + pm.MAX_SERVED


STATS = {  # what Engine.stats() reports mid-traffic (engine.py)
    "active_slots": 3, "queue_depth": 5, "steps": 41, "alive": 1, "max_slots": 8,
    "context_requests": 1, "generation_requests": 1, "context_tokens": 96, "step_time_us": 1_790_000_000_123_456,
    "kv_tokens_per_block": 32, "kv_blocks_max": 8 * 64, "kv_blocks_used": 10, "kv_blocks_reused": 4,
    "cpu_mem_bytes": 2_000_000_000, "gpu_mem_bytes": 0, "pinned_mem_bytes": 0,
}


def test_trtllm_values_from_the_engine_stats():
    v = pm.trtllm_values(STATS)
    assert v["nv_trt_llm_request_metrics"] == {"active": 3, "max": 8, "scheduled": 2, "context": 1, "waiting": 1}
    assert v["nv_trt_llm_kv_cache_block_metrics"] == {"max": 512, "free": 502, "used": 10, "tokens_per": 32,
                                                      "reused": 4, "fraction": 10 / 512}
    assert v["nv_trt_llm_inflight_batcher_metrics"] == {"total_context_tokens": 96, "generation_requests": 1,
                                                        "micro_batch_id": 0, "paused_requests": 0}
    assert v["nv_trt_llm_general_metrics"] == {"timestamp": 1_790_000_000_123_456, "iteration_counter": 41}
    assert v["nv_trt_llm_runtime_memory_metrics"] == {"cpu": 2e9, "gpu": 0, "pinned": 0}
    assert set(v) == {n for n, (k, _, _) in TRTLLM.items() if k == "gauge"}
    for family, (_, _, values) in TRTLLM.items():
        if family in v:
            assert set(v[family]) == values


def test_trtllm_values_of_an_engine_that_is_down_or_idle():
    v = pm.trtllm_values({"active_slots": 0, "queue_depth": 0, "alive": 0, "restarts": 1})  # engine_process while down
    assert all(x == 0 for family in v.values() for x in family.values())
    idle = pm.trtllm_values({**STATS, "active_slots": 0, "context_requests": 0, "generation_requests": 0,
                             "kv_blocks_used": 0})
    assert idle["nv_trt_llm_request_metrics"]["waiting"] == 0
    assert idle["nv_trt_llm_kv_cache_block_metrics"]["free"] == 512
    # a sequence that finished in the latest step is no longer active: waiting never goes negative
    assert pm.trtllm_values({**STATS, "active_slots": 1})["nv_trt_llm_request_metrics"]["waiting"] == 0


def test_engine_stats_sets_the_gauges(metrics):
    metrics.engine_stats(STATS)
    assert series("nv_trt_llm_request_metrics", request_type="max").value == 8
    assert series("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used").value == 10
    assert series("nv_trt_llm_general_metrics", general_type="iteration_counter").value == 41
    assert series("nv_trt_llm_disaggregated_serving_metrics", disaggregated_serving_type="request_count").value == 0


def test_the_operations_doc_names_every_family_and_label_value():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = doc.split("### Metrics of the vLLM and TensorRT-LLM backends")[1].split("\n## ")[0]
    for name in [*VLLM, *TRTLLM]:
        assert f"`{name}" in section, name
    for _, category, values in TRTLLM.values():
        assert category in section
        for v in values:
            assert f"`{v}`" in section or f'"{v}"' in section, v


def test_the_engine_gauges_are_set_only_when_their_values_change():
    """Each set is a message to the server, every poll (20 a second): an idle engine sends none."""
    from specguide.triton.metrics import Metrics

    registry.clear()
    m = Metrics(SimpleNamespace(MetricFamily=Family), "specguide", "1")
    names = ("specguide_active_slots", "specguide_queue_depth", "specguide_engine_alive", "specguide_draft_head_loaded")
    stats = {"active_slots": 2, "queue_depth": 0, "alive": 1, "draft_head": 1}
    for _ in range(5):
        m.engine_stats(stats)
    assert [series(n).sets for n in names] == [1, 1, 1, 1]
    assert [series(n).value for n in names] == [2.0, 0.0, 1.0, 1.0]
    m.engine_stats({**stats, "active_slots": 3})
    assert [series(n).sets for n in names] == [2, 1, 1, 1] and series(names[0]).value == 3.0
    registry.clear()


def test_the_kv_block_gauges_and_the_preemption_count_follow_the_engine():
    """specguide_kv_blocks_used / _free and specguide_preempted_sequences are the engine's figures;
    specguide_preemptions_total adds what the engine counted since the last poll (an engine started
    again counts from 0: its count is added whole)."""
    from specguide.triton.metrics import Metrics

    registry.clear()
    m = Metrics(SimpleNamespace(MetricFamily=Family), "specguide", "1")
    for n, used, preempted in ((2, 30, 1), (5, 40, 2), (5, 40, 0), (1, 3, 0)):  # (the last: a new engine)
        m.engine_stats({"active_slots": 3, "kv_blocks_used": used, "kv_blocks_free": 100 - used,
                        "preempted": preempted, "preemptions": n})
    assert series("specguide_preemptions_total").value == 6
    assert (series("specguide_kv_blocks_used").value, series("specguide_kv_blocks_free").value) == (3, 97)
    assert series("specguide_preempted_sequences").value == 0
    registry.clear()


def test_lora_metrics_count_per_adapter_and_follow_the_engine(monkeypatch):
    """Requests and tokens per adapter (a series each, up to MAX_ADAPTER_LABELS, then `other`);
    resident adapters and loads are the engine's figures."""
    from specguide.triton import metrics as mod

    registry.clear()
    monkeypatch.setattr(mod, "MAX_ADAPTER_LABELS", 2)
    m = mod.Metrics(SimpleNamespace(MetricFamily=Family), "specguide", "1")
    for adapter, tokens in (("support", 5), ("support", 7), ("task 3", 2), ("legal", 1), ("x", 4)):
        m.adapter_finished(adapter, tokens)
    assert (series("specguide_lora_requests_total", adapter="support").value,
            series("specguide_lora_generation_tokens_total", adapter="support").value) == (2, 12)
    assert series("specguide_lora_requests_total", adapter="task 3").value == 1
    assert (series("specguide_lora_requests_total", adapter="other").value,
            series("specguide_lora_generation_tokens_total", adapter="other").value) == (2, 5)
    for resident, loads in ((2, 3), (2, 3), (1, 5), (1, 2)):  # (the last: an engine started again)
        m.engine_stats({"lora_adapters_resident": resident, "lora_adapter_loads": loads})
    assert series("specguide_lora_adapters_resident").value == 1
    assert series("specguide_lora_adapter_loads_total").value == 7
    registry.clear()
