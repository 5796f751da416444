"""The three served names come from one declaration (specguide.triton.interfaces)."""
from __future__ import annotations

import re
from pathlib import Path

from specguide.triton import interfaces
from specguide.triton.interfaces import INTERFACES, write_configs

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"


def _entries(text: str, section: str) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    body = re.search(r"\n" + section + r"\s*\[(.*?)\n\]", text, re.S).group(1)
    out = {}
    for block in re.findall(r"\{(.*?)\}", body, re.S):
        name = re.search(r'name:\s*"([^"]+)"', block).group(1)
        dtype = re.search(r"data_type:\s*(\w+)", block).group(1)
        dims = tuple(int(d) for d in re.search(r"dims:\s*\[([^\]]*)\]", block).group(1).split(","))
        out[name] = (dtype, dims, re.search(r"optional:\s*true", block) is not None)
    return out


def test_served_configs_are_the_generated_ones():
    assert write_configs(REPO, check=True) == [], "run `python -m specguide.triton.interfaces`"
    served = {p.name for p in REPO.iterdir() if (p / "config.pbtxt").exists()}
    assert served == set(INTERFACES)


def test_each_config_declares_its_interface():
    for iface in INTERFACES.values():
        text = (REPO / iface.name / "config.pbtxt").read_text()
        assert re.search(rf'name:\s*"{iface.name}"', text)
        assert int(re.search(r"max_batch_size:\s*(\d+)", text).group(1)) == iface.max_batch_size
        assert bool(re.search(r"decoupled:\s*true", text)) == iface.decoupled
        ins, outs = _entries(text, "input"), _entries(text, "output")
        assert {k: v[:2] for k, v in ins.items()} == {s.name: (s.dtype, s.dims) for s in iface.inputs}
        assert {k: v[:2] for k, v in outs.items()} == {s.name: (s.dtype, s.dims) for s in iface.outputs}
        assert {k for k, v in ins.items() if not v[2]} == set(iface.required)
        model_py = (REPO / iface.name / "1" / "model.py").read_text()
        assert f"from {interfaces.MODEL_PY[iface.kind]} import TritonPythonModel" in model_py


def test_vllm_name_is_the_vllm_backends_auto_completed_config():
    # vllm_backend src/model.py auto_complete_config: these names, dtypes and dims, max_batch_size 0
    want_in = {"text_input": ("TYPE_STRING", (1,)), "image": ("TYPE_STRING", (-1,)), "stream": ("TYPE_BOOL", (1,)),
               "sampling_parameters": ("TYPE_STRING", (1,)), "exclude_input_in_output": ("TYPE_BOOL", (1,)),
               "return_finish_reason": ("TYPE_BOOL", (1,)), "return_cumulative_logprob": ("TYPE_BOOL", (1,)),
               "return_logprobs": ("TYPE_BOOL", (1,)), "return_num_input_tokens": ("TYPE_BOOL", (1,)),
               "return_num_output_tokens": ("TYPE_BOOL", (1,)), "embedding_request": ("TYPE_STRING", (1,))}
    want_out = {"text_output": ("TYPE_STRING", (-1,)), "finish_reason": ("TYPE_STRING", (-1,)),
                "cumulative_logprob": ("TYPE_FP32", (-1,)), "logprobs": ("TYPE_STRING", (-1,)),
                "num_input_tokens": ("TYPE_UINT32", (1,)), "num_output_tokens": ("TYPE_UINT32", (-1,))}
    v = INTERFACES["specguide_vllm"]
    assert {s.name: (s.dtype, s.dims) for s in v.inputs} == want_in
    assert {s.name: (s.dtype, s.dims) for s in v.outputs} == want_out
    assert v.max_batch_size == 0 and v.decoupled and v.required == ("text_input",)


def test_trtllm_names_cover_the_ensemble_and_the_core_model():
    names = set(INTERFACES["specguide"].input_names)
    ensemble = {"text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
                "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
                "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty", "random_seed",
                "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
                "beam_width", "stream", "guided_decoding_guide_type", "guided_decoding_guide"}
    core = {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
            "bad_words_list", "beam_width", "temperature", "runtime_top_k", "runtime_top_p", "len_penalty",
            "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty", "random_seed",
            "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
            "exclude_input_in_output", "stop", "streaming", "num_return_sequences"}
    assert ensemble | core <= names
    outs = set(INTERFACES["specguide"].output_names)
    assert {"text_output", "output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
            "generation_logits", "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
            "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns",
            "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
            "total_draft_tokens"} <= outs
    # the unary name has the same tensors; every alias names a real input
    assert INTERFACES["specguide_unary"].inputs == INTERFACES["specguide"].inputs
    assert not INTERFACES["specguide_unary"].decoupled
    assert set(interfaces.ALIASES.values()) <= names


def test_a_stale_config_is_found_and_rewritten(tmp_path):
    for iface in INTERFACES.values():
        (tmp_path / iface.name).mkdir()
        src = (REPO / iface.name / "config.pbtxt").read_text()
        (tmp_path / iface.name / "config.pbtxt").write_text(src.replace("TYPE_BOOL", "TYPE_INT8", 1))
    stale = write_configs(tmp_path, check=True)
    assert len(stale) == len(INTERFACES)
    write_configs(tmp_path)
    assert write_configs(tmp_path, check=True) == []
    # the engine settings (hand-kept, below the marker) survive a rewrite
    engine = (tmp_path / "specguide" / "config.pbtxt").read_text()
    assert 'key: "max_slots"' in engine and interfaces.ENGINE_SETTINGS_MARKER in engine
