"""GPU checks of the engine core (skipped when no CUDA device is present)."""
from __future__ import annotations

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine import Engine
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
    cpu = Engine(EngineConfig(device="cpu", max_slots=2, max_seq_len=256))
    gpu = Engine(EngineConfig(device="cuda", max_slots=2, max_seq_len=256))
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
    from specguide.engine import Engine

    free_before, _ = torch.cuda.mem_get_info()
    eng = Engine(EngineConfig(device="cuda", max_slots=0, max_seq_len=512, kv_cache_memory_fraction=0.05,
                              drafter="ngram", warmup=False))
    try:
        assert 1 <= eng.config.max_slots <= 256 and eng.scheduler.max_slots == eng.config.max_slots
        kv = eng.runner.kv
        assert kv.k.shape[1] == eng.config.max_slots
        assert 2 * kv.k.numel() * kv.k.element_size() <= 0.05 * free_before
    finally:
        eng.shutdown()
