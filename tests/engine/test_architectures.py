"""Small random Llama-family models (Llama 3 rope scaling, Mistral, Qwen2 QKV bias, Qwen3 q/k norms,
Phi-3 fused projections, untied head)
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
    elif kind == "qwen3":  # q/k norms, an explicit head_dim (not hidden / heads)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True))
    elif kind == "phi3":  # qkv_proj and gate_up_proj fused in the checkpoint
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, pad_token_id=0, tie_word_embeddings=False))
    else:
        raise AssertionError(kind)
    model.save_pretrained(path)
    return model.eval()


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama3", "mistral", "qwen2", "qwen3", "phi3"])
def test_random_model_matches_transformers(kind, tmp_path):
    ref_model = _make(kind, tmp_path)
    ours = load_model(tmp_path, torch.float32)
    if kind == "qwen2":
        assert ours.cfg.qkv_bias
    if kind == "qwen3":
        assert ours.cfg.qk_norm and ours.cfg.head_dim == 32
        with torch.no_grad():  # random norms, so a missing or misplaced norm shows
            for layer in ref_model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        ref_model.save_pretrained(tmp_path)
        ours = load_model(tmp_path, torch.float32)
    ids = torch.randint(0, 300, (1, 90), generator=torch.Generator().manual_seed(1))
    ref = ref_model(ids).logits[0]
    kv = KVCache(2, 2, 2, 128, ours.cfg.head_dim, torch.float32)
    ctx = ours.make_context(torch.tensor([1]), torch.arange(90)[None], [1], 90)
    got = ours.logits(ours(ids, ctx, kv))[0]
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_engine_serves_the_architecture_greedy_as_transformers_and_lossless(kind, tmp_path):
    """Through the engine (the default model's tokenizer in the folder, random weights in the
    architecture's shape): greedy tokens equal transformers' `generate`, with speculation off and at K=3."""
    import transformers as tf

    from specguide.config import EngineConfig
    from specguide.engine import Engine
    from specguide.models.default_model import prepare_default_model
    from specguide.request import Request, SamplingParams

    torch.manual_seed(0)
    common = {**COMMON, "vocab_size": 49152, "max_position_embeddings": 512}
    if kind == "qwen3":
        ref = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    else:
        ref = tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0, tie_word_embeddings=False))
    ref.eval().save_pretrained(tmp_path)
    tf.AutoTokenizer.from_pretrained(prepare_default_model()).save_pretrained(tmp_path)
    engine = Engine(EngineConfig(model_dir=str(tmp_path), max_slots=4, max_seq_len=256, num_draft_tokens=3,
                                 drafter="early_exit", draft_layers=1, warmup=False))
    try:
        prompt = engine.tokenizer.encode("one two three one two three one two three one two")
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
        for k in (0, 3):
            events = list(engine.generate(Request(prompt_ids=prompt, num_draft_tokens=k,
                                                  params=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))))
            got = [t for ev in events for t in ev.token_ids]
            assert got == want, (k, got, want)
            assert (events[-1].total_draft_tokens > 0) == (k > 0)  # K=3 really drafted (early exit: always)
    finally:
        engine.shutdown()


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    import transformers as tf

    tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel .*'gpt2'.* not supported"):
        load_model(tmp_path, torch.float32)
    tf.Phi3Config(**COMMON, partial_rotary_factor=0.5).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_model(tmp_path, torch.float32)
