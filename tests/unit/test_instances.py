"""specguide.triton.instance: which instance a stub is, where its engine runs, how its metrics are
labelled (no server needed; tests/integration/test_instances_server.py runs two instances)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specguide.process import supervisor
from specguide.triton.instance import instance_count
from specguide.triton import peer_metrics as pm
from specguide.triton.instance import Instance


class _Metric:
    def __init__(self, labels: dict):
        self.labels, self.value = dict(labels), 0.0

    def set(self, v: float) -> None:
        self.value = v

    def increment(self, v: float) -> None:
        self.value += v


class Family:
    """pb_utils.MetricFamily as the metric modules use it; `registry` holds every family made."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.kind, self.metrics = name, kind, []
        registry[name] = self

    def Metric(self, labels: dict, buckets=None) -> _Metric:  # noqa: N802 (pb_utils' name)
        m = _Metric(labels)
        self.metrics.append(m)
        return m


registry: dict[str, Family] = {}


def test_instance_from_triton_args_and_its_label():
    cpu = Instance.from_args({"model_instance_name": "specguide_0_1", "model_instance_kind": "CPU",
                              "model_instance_device_id": "0"})
    assert (cpu.name, cpu.kind, cpu.device_id, cpu.label) == ("specguide_0_1", "CPU", 0, "specguide_0_1")
    # Triton names the instances of a KIND_GPU group alike on every GPU: the label adds the GPU
    gpus = [Instance.from_args({"model_instance_name": "specguide_0_0", "model_instance_kind": "GPU",
                                "model_instance_device_id": str(i)}) for i in (0, 1)]
    assert [g.label for g in gpus] == ["specguide_0_0_gpu0", "specguide_0_0_gpu1"]
    assert Instance.from_args({}, "specguide").label == "specguide_0_0"  # a stub of an old server


def test_each_gpu_instance_runs_its_engine_on_its_own_gpu():
    gpu1 = Instance("specguide_0_0", "GPU", 1)
    assert [gpu1.engine_device(d) for d in ("auto", "cuda", "cuda:1")] == ["cuda:1"] * 3
    for wrong in ("cpu", "cuda:0"):  # two engines on one device by accident: refused, with the fix
        with pytest.raises(ValueError, match="set device to auto"):
            gpu1.engine_device(wrong)
    cpu = Instance("specguide_0_1", "CPU", 0)
    assert cpu.engine_device("auto") == cpu.engine_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="KIND_CPU"):
        cpu.engine_device("cuda")
    model = Instance("specguide_0_0", "MODEL", 0)  # the shipped config: the engine places itself
    assert [model.engine_device(d) for d in ("auto", "cpu", "cuda:3")] == ["auto", "cpu", "cuda:3"]


def test_instance_count_of_a_config():
    assert instance_count({}) == 1
    assert instance_count({"instance_group": [{"count": 1, "kind": "KIND_MODEL"}]}) == 1
    assert instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == 2
    assert instance_count({"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1, 2]},
                                              {"count": 2, "kind": "KIND_CPU"}]}) == 5


@pytest.fixture
def two_engines():
    registry.clear()
    yield [pm.PeerMetrics(SimpleNamespace(MetricFamily=_Shared), "specguide", "1", 2048, instance=i)
           for i in ("specguide_0_0", "specguide_0_1")]
    registry.clear()


class _Shared(Family):
    """Triton's registry: a family registered again by another stub is the same family."""

    def __new__(cls, name, description, kind):
        return registry.get(name) or super().__new__(cls)

    def __init__(self, name, description, kind):
        if name not in registry:
            super().__init__(name, description, kind)


def test_two_engines_keep_their_state_gauges_apart(two_engines):
    a, b = two_engines
    a.engine_stats({"max_slots": 8, "active_slots": 3})
    b.engine_stats({"max_slots": 8, "active_slots": 1})
    active = {m.labels["model_instance"]: m.value for m in registry["nv_trt_llm_request_metrics"].metrics
              if m.labels["request_type"] == "active"}
    assert active == {"specguide_0_0": 3, "specguide_0_1": 1}
    # the per-request families stay labelled as the vLLM backend labels them: model and version
    assert all(set(m.labels) == {"model", "version"} for m in registry["vllm:prompt_tokens_total"].metrics)


def test_one_engine_labels_its_state_as_tensorrt_llm_does():
    registry.clear()
    pm.PeerMetrics(SimpleNamespace(MetricFamily=Family), "specguide", "1", 2048)
    assert all("model_instance" not in m.labels for m in registry["nv_trt_llm_request_metrics"].metrics)
    registry.clear()


def test_specguide_metrics_carry_the_instance():
    from specguide.triton.metrics import Metrics

    registry.clear()
    Metrics(SimpleNamespace(MetricFamily=Family), "specguide", "1", "specguide_0_1")
    for family in registry.values():
        assert family.metrics and all(m.labels["model_instance"] == "specguide_0_1" and m.labels["model"] == "specguide"
                                      for m in family.metrics), family.name
    registry.clear()


def test_the_supervisor_finds_a_dead_stub_among_live_instances(monkeypatch):
    """Two instances of `specguide`: one stub gone is a dead stub, though the model still has one."""
    live = {"specguide": [101, 102], "specguide_vllm": [103]}
    monkeypatch.setattr(supervisor, "ready_models", lambda http: ["specguide", "specguide_vllm"])
    monkeypatch.setattr(supervisor, "stubs", lambda pid: live)
    asked: list[str] = []
    monkeypatch.setattr(supervisor, "model_instances",
                        lambda http, m: asked.append(m) or (2 if m == "specguide" else 1))
    sup = supervisor.Supervisor(["true"], "127.0.0.1:1")
    sup.proc = SimpleNamespace(pid=1)
    assert sup.dead_stub() is None
    live["specguide"] = [102]
    assert sup.dead_stub() == "specguide"
    assert sorted(asked) == ["specguide", "specguide_vllm"]  # each config read once while READY
