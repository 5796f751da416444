"""LoRA on a small random Llama whose adapter pieces do not fall on the C kernels' tiles of 64
outputs (q 96 outputs, k and v 32 each from output 96, gate and up 100 each): the C stack's logits
are peft's, and the torch path's, in every adapter dtype; rows with different adapters or none in
one forward keep the bits they have alone, with several tokens a row (the kernel's tokens that
share an adapter's weights)."""
from __future__ import annotations

import pytest
import torch

from specguide.engine.kv_cache import KVCache
from specguide.models.loader import load_model
from specguide.models.lora import LoRABank, load_adapter

from ..lora_helpers import ALL

SHAPE = dict(vocab_size=300, hidden_size=96, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
RANKS = {"a8": 8, "b12": 12}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(our model, peft model holding both adapters, {name: folder})."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("tiny-lora")
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).eval()
    hf.save_pretrained(root / "model")
    pm = None
    for name, r in RANKS.items():
        conf = LoraConfig(init_lora_weights=False, r=r, lora_alpha=r, target_modules=ALL)
        if pm is None:
            pm = get_peft_model(hf, conf, adapter_name=name)
        else:
            pm.add_adapter(name, conf)
    pm.eval()
    pm.save_pretrained(root / "loras")
    ours = load_model(root / "model", torch.float32)
    assert ours.fused is not None  # the C stack: the path under test
    return ours, pm, {name: root / "loras" / name for name in RANKS}


def _logits(model, kv, rows: list[list[int]], slots: list[int]) -> torch.Tensor:
    T = len(rows[0])
    ctx = model.make_context(torch.tensor(slots), torch.arange(T)[None].repeat(len(rows), 1), slots, T)
    return model.logits(model(torch.tensor(rows), ctx, kv))  # [rows, T, vocab]


@torch.inference_mode()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_unaligned_pieces_match_peft_and_the_torch_path_and_keep_each_rows_bits(tiny, dtype):
    ours, pm, folders = tiny
    ids = [[(7 * i + 3 * j) % 290 + 5 for i in range(12)] for j in range(3)]
    bank = LoRABank(ours.cfg, 4, 2)
    for i, name in enumerate(RANKS):
        bank.place(i, load_adapter(name, folders[name], ours.cfg, dtype))
    for row, index in ((0, 0), (1, -1), (2, 1)):
        bank.bind(row, index)
    kv = KVCache(2, 4, 2, 64, 16, torch.float32)
    fused = ours.fused
    ours.lora = bank
    try:
        alone = [_logits(ours, kv, [ids[r]], [r])[0] for r in range(3)]
        together = _logits(ours, kv, ids, [0, 1, 2])
        for r in range(3):
            assert torch.equal(together[r], alone[r]), r
        ours.fused = None
        torch_path = [_logits(ours, kv, [ids[r]], [r])[0] for r in range(3)]
    finally:
        ours.fused, ours.lora = fused, None
    with pm.disable_adapter():
        base = [pm(torch.tensor([row])).logits[0] for row in ids]
    assert (alone[1] - base[1]).abs().max().item() < 1e-4  # the row without an adapter
    for r, name in ((0, "a8"), (2, "b12")):
        pm.set_adapter(name)
        want = pm(torch.tensor([ids[r]])).logits[0]
        moved = (want - base[r]).abs().max().item()
        assert moved > 0.05, name  # the adapter does change the logits
        assert (torch_path[r] - alone[r]).abs().max().item() < 1e-4, name  # the same values, two paths
        err = (alone[r] - want).abs().max().item()
        assert err < (1e-4 if dtype == "float32" else 0.05 * moved), (name, err, moved)
