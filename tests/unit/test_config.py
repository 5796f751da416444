"""EngineConfig refuses a bad setting with a ValueError that names it (not an assert: `python -O` keeps it)."""
from __future__ import annotations

import pytest

from specguide.config import EngineConfig


@pytest.mark.parametrize("kwargs, words", [
    ({"dtype": "float8"}, "dtype must be one of"),
    ({"weight_dtype": "int4"}, "weight_dtype must be one of"),
    ({"draft_head_weight_dtype": "int4"}, "draft_head_weight_dtype must be"),
    ({"device": "tpu"}, "device must be cpu, cuda"),
    ({"max_slots": 0}, "max_slots must be >= 1, got 0"),
    ({"max_seq_len": 8}, "max_seq_len must be >= 16, got 8"),
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
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        EngineConfig.from_parameters({"max_slots": {"string_value": "0"}})
    with pytest.raises(ValueError, match="expected a boolean"):
        EngineConfig.from_parameters({"warmup": "maybe"})


def test_defaults_are_valid_and_derived_limits_are_filled():
    cfg = EngineConfig()
    assert cfg.max_tokens_limit == cfg.max_seq_len and cfg.max_prompt_bytes == 16 * cfg.max_seq_len


def test_reasoning_markers_parse():
    from specguide.config import ReasoningMarkers

    assert EngineConfig().reasoning() is None and EngineConfig(reasoning_markers="  ").reasoning() is None
    assert EngineConfig(reasoning_markers=" <think> , </think> ").reasoning() == ReasoningMarkers("<think>", "</think>")
    cfg = EngineConfig.from_parameters({"reasoning_markers": {"string_value": "<think>,</think>"}})
    assert cfg.reasoning() == ReasoningMarkers("<think>", "</think>")
