"""EngineConfig refuses a bad setting with a ValueError that names it (not an assert: `python -O` keeps it)."""
from __future__ import annotations

import pytest

from specguide.config import EngineConfig


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float8"}, "dtype must be one of"),
    ({"weight_dtype": "int4"}, "weight_dtype must be one of"),
    ({"draft_head_weight_dtype": "int4"}, "draft_head_weight_dtype must be"),
    ({"device": "tpu"}, "device must be cpu, cuda"),
    ({"max_slots": -1}, "max_slots must be >= 0, got -1"),
    ({"kv_cache_memory_fraction": 0.0}, r"kv_cache_memory_fraction must be in \(0, 1\], got 0.0"),
    ({"kv_cache_memory_fraction": 1.5}, r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"),
    ({"max_seq_len": 8}, "max_seq_len must be 0 or >= 16, got 8"),
    ({"prefill_chunk": 0}, "prefill_chunk must be >= 1"),
    ({"max_queue": 0}, "max_queue must be >= 1"),
    ({"num_draft_tokens": 16}, r"num_draft_tokens must be in \[0, 15\], got 16"),
    ({"num_draft_tokens": -1}, r"num_draft_tokens must be in \[0, 15\], got -1"),
    ({"drafter": "oracle"}, "unknown drafter 'oracle'"),
    ({"ngram_trust": 0}, "ngram_trust must be >= 1"),
    ({"spec_max_rows": -1}, "spec_max_rows must be >= 0"),
    ({"guided_compile_workers": 0}, "guided_compile_workers must be >= 1"),
    ({"guided_compile_timeout_s": -1.0}, "guided_compile_timeout_s must be >= 0"),
    ({"guided_backend": "outlines"}, "unknown guided_backend 'outlines'"),
    ({"guided_executor": "gpu"}, "unknown guided_executor 'gpu'"),
    ({"request_timeout_s": -1.0}, "request_timeout_s must be >= 0"),
    ({"drain_timeout_s": -1.0}, "drain_timeout_s must be >= 0"),
    ({"gil_switch_interval_ms": -0.1}, "gil_switch_interval_ms must be >= 0"),
    ({"engine_nice": -1}, "engine_nice must be >= 0"),
    ({"engine_nice": 20}, r"engine_nice must be in \[0, 19\], got 20"),
    ({"guided_max_guide_bytes": -1}, "guided_max_guide_bytes must be >= 0"),
    ({"max_sampling_parameters_bytes": -1}, "max_sampling_parameters_bytes must be >= 0"),
    ({"reasoning_markers": "</think>"}, r"reasoning_markers must be '' \(off\) or '<start>,<end>'"),
    ({"reasoning_markers": "<think>,"}, r"reasoning_markers must be '' \(off\) or '<start>,<end>'"),
    ({"reasoning_markers": "<a>,<b>,<c>"}, r"reasoning_markers must be '' \(off\) or '<start>,<end>'"),
    ({"reasoning_markers": "<think>,think>"}, "the end marker 'think>' must not occur in the start marker"),
])
def test_a_bad_setting_raises_value_error_naming_it(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


def test_bad_parameters_from_config_pbtxt_raise_value_error():
    with pytest.raises(ValueError, match="max_slots must be >= 0"):
        EngineConfig.from_parameters({"max_slots": {"string_value": "-2"}})
    with pytest.raises(ValueError, match="expected a boolean"):
        EngineConfig.from_parameters({"warmup": "maybe"})


def test_defaults_are_valid_and_derived_limits_are_filled():
    """max_seq_len 0 (the model's context) leaves the limits derived from it open until the engine
    resolves it: its config (a dataclasses.replace) derives them from the model's length."""
    import dataclasses

    cfg = EngineConfig()
    assert cfg.max_seq_len == 0 and cfg.max_tokens_limit == 0 and cfg.max_prompt_bytes == 0
    resolved = dataclasses.replace(cfg, max_seq_len=8192)
    assert resolved.max_tokens_limit == 8192 and resolved.max_prompt_bytes == 16 * 8192
    set_ = EngineConfig(max_seq_len=2048, max_prompt_bytes=1000)
    assert set_.max_tokens_limit == 2048 and set_.max_prompt_bytes == 1000
    with pytest.raises(ValueError, match="max_seq_len must be 0 or >= 16"):
        EngineConfig(max_seq_len=8)


def test_the_defaults_are_what_the_shipped_config_pbtxt_serves():
    """One set of defaults: `EngineConfig()` equals the engine settings of the shipped
    model_repository/specguide/config.pbtxt (read as the Triton adapter receives them), so an engine
    a test (or a user) builds with the defaults runs what `make serve` serves, and every setting is
    declared there. No field is left out of the comparison: the deployment-specific ones (model_dir,
    gguf_file, draft_head_path, draft_model_dir: which checkpoint and head a repository serves;
    device, max_slots: the machine) are "" / auto / 0 in the shipped repository, which are the
    defaults' meanings too (the embedded default model, the model cache's head, the machine's own
    device and slot count). A change to either side must be made to both."""
    from dataclasses import fields
    from pathlib import Path

    from specguide.triton.interfaces import engine_parameters

    params = engine_parameters(Path(__file__).resolve().parents[2] / "model_repository")
    names = [f.name for f in fields(EngineConfig)]
    assert sorted(set(names) - set(params)) == [], "settings config.pbtxt does not declare"
    served, default = EngineConfig.from_parameters(params), EngineConfig()
    drift = {n: (getattr(default, n), getattr(served, n)) for n in names if getattr(default, n) != getattr(served, n)}
    assert drift == {}, f"EngineConfig() default vs config.pbtxt: {drift}"
    assert default == served


def test_reasoning_markers_parse():
    from specguide.config import ReasoningMarkers

    assert EngineConfig().reasoning() is None and EngineConfig(reasoning_markers="  ").reasoning() is None
    assert EngineConfig(reasoning_markers=" <think> , </think> ").reasoning() == ReasoningMarkers("<think>", "</think>")
    cfg = EngineConfig.from_parameters({"reasoning_markers": {"string_value": "<think>,</think>"}})
    assert cfg.reasoning() == ReasoningMarkers("<think>", "</think>")


def test_max_slots_0_is_64_on_cpu_and_sized_from_free_memory_on_cuda(caplog):
    """On CUDA, max_slots 0 becomes what kv_cache_memory_fraction of the free memory holds (TensorRT-LLM's
    kv_cache_free_gpu_mem_fraction): the sizing maths on the default model's shapes, without a GPU."""
    import logging
    from types import SimpleNamespace

    import torch

    from specguide.engine.kv_cache import size_slots
    from specguide.engine.kv_cache import slot_bytes, slots_for_memory

    assert EngineConfig(device="cpu").max_slots == 64 and EngineConfig(max_slots=0, device="cpu").max_slots == 64
    # device auto (the default, as served): the engine decides (64 on CPU), without importing torch here
    assert EngineConfig().max_slots == EngineConfig(device="auto").max_slots == 0
    assert EngineConfig(max_slots=3).max_slots == 3
    assert slots_for_memory(10 << 30, 0.5, 1 << 30) == 5 and slots_for_memory(1 << 20, 0.9, 1 << 30) == 1
    assert slots_for_memory(1 << 50, 1.0, 1 << 20) == 256  # capped
    smol = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576)
    cfg = EngineConfig(device="cpu", max_seq_len=2048, num_draft_tokens=3, kv_cache_memory_fraction=0.5)
    per = slot_bytes(30, 3, 64, 576, 2048 + 4, 4)
    assert per == 2 * 31 * 3 * 64 * 2052 * 4 + 576 * 2052 * 4  # K and V of 30 layers + the head's layer, features
    with caplog.at_level(logging.INFO, logger="specguide"):
        sized = size_slots(cfg, smol, torch.device("cpu"), free_bytes=80 << 30)
    assert sized.max_slots == min(256, (40 << 30) // per) and sized.max_slots > 8
    assert sized.max_slots * per <= 0.5 * (80 << 30) and f"max_slots {sized.max_slots}:" in caplog.text
    assert size_slots(cfg, smol, torch.device("cpu"), free_bytes=1 << 20).max_slots == 1


def test_the_own_model_docs_example_is_valid_config_pbtxt_for_the_engine(tmp_path):
    """docs/own-model.md: its config.pbtxt lines, pasted into a copy of the shipped
    repository's engine settings, parse as Triton parses them and make a valid EngineConfig."""
    import re
    import shutil
    from pathlib import Path

    from specguide.triton.interfaces import ENGINE_MODEL, engine_parameters

    root = Path(__file__).resolve().parents[2]
    section = (root / "docs" / "own-model.md").read_text()
    example = re.search(r"```\n(parameters \{.*?)```", section, re.S).group(1)
    repo = tmp_path / "repo"
    shutil.copytree(root / "model_repository" / ENGINE_MODEL, repo / ENGINE_MODEL)
    config = repo / ENGINE_MODEL / "config.pbtxt"
    text = config.read_text()
    for key in re.findall(r'key: "(\w+)"', example):  # the example replaces the shipped entries
        text, n = re.subn(r'parameters \{\s*key: "%s"\s*value: \{[^}]*\}\s*\}' % key, "", text)
        assert n == 1, key
    config.write_text(text + "\n" + example)
    params = engine_parameters(repo)
    assert set(params) <= set(EngineConfig.__dataclass_fields__)
    cfg = EngineConfig.from_parameters(params)
    assert cfg.model_dir.startswith("/") and cfg.reasoning() is not None and cfg.max_seq_len == 4096


def test_an_unknown_parameter_is_an_error_naming_the_nearest_setting():
    with pytest.raises(ValueError, match="unknown engine setting 'max_slot' in config.pbtxt; did you mean 'max_slots'"):
        EngineConfig.from_parameters({"max_slot": {"string_value": "4"}})
    with pytest.raises(ValueError, match="unknown engine setting 'zzz'"):
        EngineConfig.from_parameters({"zzz": "1"})
    # Triton's and the Python backend's own keys (upper case: EXECUTION_ENV_PATH, ...) are theirs
    assert EngineConfig.from_parameters({"EXECUTION_ENV_PATH": {"string_value": "/env.tar.gz"}}) == EngineConfig()


def test_the_kv_blocks_come_from_kv_cache_bytes_or_the_memory_fraction_and_cap_max_seq_len(caplog):
    """size_blocks: every slot at max_seq_len when memory holds it; else what `kv_cache_bytes` (or
    the fraction of the free memory) holds, with max_seq_len cut to what one sequence may hold in
    all of them (logged); too few for one sequence: a clear error. block_bytes: the default model's
    block in fp16 with the draft head's K/V and features in fp32."""
    import logging
    from types import SimpleNamespace

    import torch

    from specguide.engine.kv_cache import block_bytes, size_blocks

    smol = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576)
    per = block_bytes(smol, torch.float16, torch.float32, head=True)
    assert per == 16 * (2 * 30 * 3 * 64 * 2 + (2 * 3 * 64 + 576) * 4)
    assert block_bytes(smol, torch.int8, torch.float32, head=False) == 16 * 2 * 30 * 3 * (64 + 4)
    cfg = EngineConfig(device="cpu", max_slots=8, max_seq_len=2048, num_draft_tokens=3)
    per_seq = -(-(2048 + 4) // 16)
    n, same = size_blocks(cfg, smol, torch.device("cpu"), per, free_bytes=80 << 30)
    assert n == 1 + 8 * per_seq and same.max_seq_len == 2048  # all of it: every slot at max_seq_len
    n, same = size_blocks(dataclasses_replace(cfg, kv_cache_bytes=200 * per), smol, torch.device("cpu"), per)
    assert n == 200 and same.max_seq_len == 2048  # kv_cache_bytes, whatever is free
    with caplog.at_level(logging.WARNING, logger="specguide"):
        n, cut = size_blocks(dataclasses_replace(cfg, kv_cache_memory_fraction=0.5), smol, torch.device("cpu"), per,
                             free_bytes=100 * per)
    assert n == 50 and cut.max_seq_len == 49 * 16 - 4 and "max_seq_len 2048 -> 780" in caplog.text
    with pytest.raises(ValueError, match="too few for one sequence"):
        size_blocks(dataclasses_replace(cfg, kv_cache_bytes=per), smol, torch.device("cpu"), per)


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)
