"""GPU checks of the engine core (skipped when no CUDA device is present)."""
from __future__ import annotations

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import Request, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


def _greedy(engine, prompt, n=32):
    toks = []
    for ev in engine.generate(Request(prompt=prompt, params=SamplingParams(max_tokens=n, temperature=0,
                                                                            ignore_eos=True))):
        toks += ev.token_ids
    return toks


def test_cuda_fp32_greedy_matches_cpu():
    # fp32 on both: the CPU's float32 weights and activations (its default, as served, is auto / int8);
    # n-gram drafts on both (the trained head of the default drafter may be missing on the GPU machine)
    cpu = Engine(EngineConfig(device="cpu", max_slots=2, max_seq_len=256, weight_dtype="float32",
                              activation_dtype="float32", drafter="ngram"))
    gpu = Engine(EngineConfig(device="cuda", max_slots=2, max_seq_len=256, drafter="ngram"))
    try:
        for p in PROMPTS:
            a, b = _greedy(cpu, p), _greedy(gpu, p)
            # TF32/cuBLAS rounding may flip a near-tie late in the sequence; the start must agree
            assert a[:8] == b[:8], p
    finally:
        cpu.shutdown()
        gpu.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_runs_a_batch(dtype):
    eng = Engine(EngineConfig(device="cuda", dtype=dtype, max_slots=4, max_seq_len=256))
    try:
        outs = [_greedy(eng, p, 16) for p in PROMPTS]
        assert all(len(o) == 16 for o in outs)
        assert eng.stats()["active_slots"] == 0
    finally:
        eng.shutdown()


def test_cuda_max_slots_0_sizes_the_kv_cache_from_free_memory():
    """max_slots 0 on CUDA: slots from kv_cache_memory_fraction of the free memory, and the KV cache
    allocated stays within that share."""
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    free_before, _ = torch.cuda.mem_get_info()
    eng = Engine(EngineConfig(device="cuda", max_slots=0, max_seq_len=512, kv_cache_memory_fraction=0.05,
                              drafter="ngram", warmup=False))
    try:
        assert 1 <= eng.config.max_slots <= 256 and eng.core.scheduler.max_slots == eng.config.max_slots
        kv = eng.core.runner.kv
        assert kv.k.shape[1] == eng.config.max_slots
        assert 2 * kv.k.numel() * kv.k.element_size() <= 0.05 * free_before
    finally:
        eng.shutdown()


def test_a_tiny_head_trains_on_cuda_and_drafts_there(tmp_path):
    """scripts/train_draft_head.py on a CUDA machine: the corpus is answered on the GPU with its
    features kept on the way (CUDA graphs paused meanwhile), the head trains there (bf16 autocast
    where supported), and it drafts in a CUDA engine without changing the greedy start."""
    from specguide.training.train_head import TrainConfig, run

    from ..guided.helpers import load_guided_samples

    schemas = [s.text for s in load_guided_samples() if s.kind == "json_schema" and "unsupported" not in s.name][:6]
    eng = Engine(EngineConfig(device="cuda", max_slots=8, max_seq_len=1024, drafter="grammar"))
    try:
        cfg = TrainConfig(seed=0, epochs=2, num_schemas=6, num_chat=6, max_tokens_json=48, max_tokens_chat=32,
                          draft_vocab=4096, depth=2, val_fraction=0.25)
        head, report, _ = run(cfg, engine=eng, schemas=schemas)
        assert eng.core.runner.core.feature_sink is None  # the recording detached again
        assert report.matmul_dtype == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
        assert report.samples >= 10 and report.val_accuracy[0] > 0.05, report
        path = tmp_path / "head.pt"
        head.save(path, {})
    finally:
        eng.shutdown()
    off = Engine(EngineConfig(device="cuda", max_slots=4, max_seq_len=512, num_draft_tokens=0))
    on = Engine(EngineConfig(device="cuda", max_slots=4, max_seq_len=512, num_draft_tokens=3, drafter="head",
                             draft_head_path=str(path), adaptive_k=False))
    try:
        assert on.core.head_drafter is not None
        for p in PROMPTS:  # cuBLAS may round a verification row unlike a single step: the start must agree
            assert _greedy(on, p)[:8] == _greedy(off, p)[:8], p
        assert on.stats()["active_slots"] == 0
    finally:
        off.shutdown()
        on.shutdown()
