"""Our Llama forward matches transformers within 1e-3 (fp32) on the real SmolLM2."""
from __future__ import annotations

import pytest
import torch

from specguide.engine.kv_cache import KVCache
from specguide.models.embedding import Q8Rows
from specguide.models.loader import cpu_bf16_matmuls, load_model

from .conftest import PROMPTS

TOL = 1e-3


@pytest.fixture(scope="module")
def ours(model_dir):
    return load_model(model_dir, torch.float32)


def _forward(model, kv, ids, slot, start):
    T = len(ids)
    positions = torch.arange(start, start + T)[None, :]
    ctx = model.make_context(torch.tensor([slot]), positions, [slot], start + T)
    return model.logits(model(torch.tensor([ids]), ctx, kv))[0]


@torch.inference_mode()
@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_prefill_and_stepwise_decode_match_transformers(ours, hf_model, model_dir, prompt):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(prompt)
    ref = hf_model(torch.tensor([ids])).logits[0]
    kv = KVCache(30, 4, 3, 128, 64, torch.float32)
    prefill = _forward(ours, kv, ids, slot=3, start=0)
    assert (prefill - ref).abs().max().item() < TOL
    # prefill 2 tokens, then one token at a time in another slot
    steps = [_forward(ours, kv, ids[:2], slot=1, start=0)]
    steps += [_forward(ours, kv, ids[t:t + 1], slot=1, start=t) for t in range(2, len(ids))]
    assert (torch.cat(steps) - ref).abs().max().item() < TOL


@torch.inference_mode()
def test_the_embedding_is_held_in_q8_0_blocks_with_the_checkpoints_exact_values(ours, hf_model):
    """The default model's embedding is a GGUF Q8_0 tensor: held as its blocks (28 of 108 MiB), each
    row looked up is transformers' fp32 row bit for bit."""
    assert isinstance(ours.embed, Q8Rows)
    want = hf_model.model.embed_tokens.weight
    assert torch.equal(ours.embed(torch.arange(want.shape[0])).view(torch.int32), want.view(torch.int32))
    assert ours.embed.q.nbytes + ours.embed.d.nbytes < want.nbytes / 3


@torch.inference_mode()
def test_batched_decode_over_non_consecutive_slots(ours, hf_model, model_dir):
    """Rows in slots 0 and 2 (a gather, not a view) with different lengths attend only to their own keys."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[3])
    kv = KVCache(30, 4, 3, 128, 64, torch.float32)
    _forward(ours, kv, a[:-1], slot=0, start=0)
    _forward(ours, kv, b[:-1], slot=2, start=0)
    positions = torch.tensor([[len(a) - 1], [len(b) - 1]])
    ctx = ours.make_context(torch.tensor([0, 2]), positions, [0, 2], max(len(a), len(b)))
    assert ctx.slot_range is None
    logits = ours.logits(ours(torch.tensor([[a[-1]], [b[-1]]]), ctx, kv))[:, 0]
    for row, ids in zip(logits, (a, b)):
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
        assert (row - ref).abs().max().item() < TOL


@torch.inference_mode()
def test_bf16_stays_close_to_fp32(model_dir):
    if not cpu_bf16_matmuls():
        pytest.skip("torch has no bf16 matmuls on this CPU (AVX-512 bw/vl/dq or AVX-NE-CONVERT needed)")
    ours16 = load_model(model_dir, torch.bfloat16)
    ours32 = load_model(model_dir, torch.float32)
    ids = list(range(100, 140))
    kv16 = KVCache(30, 1, 3, 64, 64, torch.bfloat16)
    kv32 = KVCache(30, 1, 3, 64, 64, torch.float32)
    l16, l32 = _forward(ours16, kv16, ids, 0, 0), _forward(ours32, kv32, ids, 0, 0)
    assert l16.dtype == torch.float32
    agree = (l16.argmax(-1) == l32.argmax(-1)).float().mean().item()
    assert agree > 0.8, agree


def test_bf16_is_refused_up_front_where_the_cpu_has_no_bf16_matmuls(model_dir, monkeypatch):
    """Not a crash at the first forward: a load error that names the CPU's lack and the way out."""
    from specguide.models import loader

    monkeypatch.setattr(loader, "cpu_bf16_matmuls", lambda: False)
    with pytest.raises(ValueError, match="bf16 matmuls need .* use dtype float32"):
        load_model(model_dir, torch.bfloat16)
    assert load_model(model_dir, torch.float32).dtype == torch.float32  # fp32 does not need them


@torch.inference_mode()
def test_decode_logits_are_batch_and_query_count_invariant(ours):
    """A slot's logits are bit-identical alone, inside a batch, and as one row of a multi-token step."""
    if not ours.invariant_attention:
        pytest.skip("C kernels unavailable")
    kv = KVCache(30, 8, 3, 64, 64, torch.float32)
    prompt = list(range(300, 320))
    for s in range(8):
        _forward(ours, kv, prompt, slot=s, start=0)
    nxt = [11, 12, 13, 14]

    def step(slots, tokens_per_slot):
        T = len(tokens_per_slot)
        ids = torch.tensor([tokens_per_slot] * len(slots))
        pos = torch.arange(20, 20 + T).expand(len(slots), T)
        ctx = ours.make_context(torch.tensor(slots), pos, slots, 20 + T)
        return ours.logits(ours(ids, ctx, kv))

    alone = step([5], nxt[:1])[0, 0]
    assert torch.equal(step(list(range(8)), nxt[:1])[5, 0], alone)
    assert torch.equal(step([2, 5], nxt[:1])[1, 0], alone)
    # T = 4 queries at once (a verification step) == 4 single-token steps
    four = step([5], nxt)[0]
    assert torch.equal(four[0], step([5], nxt[:1])[0, 0])
    for i in range(1, 4):  # feed one token at a time at positions 20..23
        ids = torch.tensor([[nxt[i]]])
        ctx = ours.make_context(torch.tensor([5]), torch.tensor([[20 + i]]), [5], 21 + i)
        assert torch.equal(ours.logits(ours(ids, ctx, kv))[0, 0], four[i])
