"""Small random Llama-family models (Llama 3 rope scaling, Mistral, Qwen2 QKV bias, untied head)
saved as HF folders: our loader + forward match transformers."""
from __future__ import annotations

import pytest
import torch

from specguide.kv_cache import KVCache
from specguide.models.loader import load_model

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _make(kind: str, path):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama3":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=None))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))
    else:
        raise AssertionError(kind)
    model.save_pretrained(path)
    return model.eval()


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2"])
def test_random_model_matches_transformers(kind, tmp_path):
    ref_model = _make(kind, tmp_path)
    ours = load_model(tmp_path, torch.float32)
    if kind == "qwen2":
        assert ours.cfg.qkv_bias
    ids = torch.randint(0, 300, (1, 90), generator=torch.Generator().manual_seed(1))
    ref = ref_model(ids).logits[0]
    kv = KVCache(2, 2, 2, 128, 16, torch.float32)
    ctx = ours.make_context(torch.tensor([1]), torch.arange(90)[None], [1], 90)
    got = ours.logits(ours(ids, ctx, kv))[0]
    assert (got - ref).abs().max().item() < 1e-4
