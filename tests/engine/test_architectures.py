"""Small random Llama-family models (Llama 3 rope scaling, Mistral, Qwen2 QKV bias, Qwen3 q/k norms,
Phi-3 fused projections, untied head, Gemma 2 / Gemma 3 with a sliding window of 6 keys)
saved as HF folders: our loader + forward match transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specguide import kernels
from specguide.engine.kv_cache import KVCache
from specguide.models.loader import load_model

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# head_dim != hidden / heads, a query_pre_attn_scalar != head_dim, a window far shorter than the prompts
GEMMA = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6, "initializer_range": 0.1}


def _gemma(kind: str, common: dict):
    """Gemma 2 (soft-capped scores and logits) or Gemma 3 (q/k norms, the local layers' own RoPE
    theta, linearly scaled global RoPE); layer 0 sliding, layer 1 full; random norm weights."""
    import transformers as tf

    if kind == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, **GEMMA, attn_logit_softcapping=5.0,
                                                     final_logit_softcapping=3.0))
    else:
        text = tf.Gemma3TextConfig(**common, **GEMMA, sliding_window_pattern=2, rope_local_base_freq=100.0,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0})
        if kind == "gemma3":
            model = tf.Gemma3ForCausalLM(text)
        else:  # a multimodal checkpoint: its text model is served
            vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8)
            model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
                text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                boi_token_index=297, eoi_token_index=298))
    with torch.no_grad():  # (1 + w) norms: a missing offset or a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name and "vision" not in name:
                p.uniform_(-0.5, 0.5)
    return model


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
    elif kind == "mistral_sw":  # every layer sliding (Mistral 7B v0.1's 4096, here 6 keys)
        model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=6))
    elif kind == "qwen2_sw":  # use_sliding_window: layers from max_window_layers on slide
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=6,
                                                   max_window_layers=1))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))
    elif kind == "qwen3":  # q/k norms, an explicit head_dim (not hidden / heads)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True))
    elif kind == "phi3":  # qkv_proj and gate_up_proj fused in the checkpoint
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, pad_token_id=0, tie_word_embeddings=False))
    elif kind.startswith("gemma"):
        model = _gemma(kind, COMMON)
    else:
        raise AssertionError(kind)
    model.save_pretrained(path)
    return model.eval()


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama3", "mistral", "mistral_sw", "qwen2", "qwen2_sw", "qwen3", "phi3", "gemma2",
                                  "gemma3", "gemma3_mm"])
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
    ids = torch.randint(0, 290, (1, 90), generator=torch.Generator().manual_seed(1))
    ref = ref_model(ids).logits[0]
    kv = KVCache(2, 2, 2, 128, ours.cfg.head_dim, torch.float32)
    ctx = ours.make_context(torch.tensor([1]), torch.arange(90)[None], [1], 90)
    got = ours.logits(ours(ids, ctx, kv))[0]
    assert (got - ref).abs().max().item() < 1e-4
    if kernels.library() is not None:  # that was the whole stack in one C call; layer by layer matches too
        assert ours.fused is not None and len(ours.fused) == 2
        fused, ours.fused = ours.fused, None
        try:
            layerwise = ours.logits(ours(ids, ctx, KVCache(2, 2, 2, 128, ours.cfg.head_dim, torch.float32)))[0]
        finally:
            ours.fused = fused
        assert (layerwise - ref).abs().max().item() < 1e-4 and (layerwise - got).abs().max().item() < 1e-4
    if kind.startswith("gemma"):
        assert ours.cfg.sliding == (True, False) and ours.cfg.sliding_window == 6
        assert (ours.cfg.attn_softcap, ours.cfg.final_softcap) == ((5.0, 3.0) if kind == "gemma2" else (0.0, 0.0))
        _check_the_window_matters(tmp_path, ids, ref)
    if kind.endswith("_sw"):
        assert ours.cfg.sliding == ((True, True) if kind == "mistral_sw" else (False, True))
        _check_the_window_matters(tmp_path, ids, ref)


def _check_the_window_matters(path, ids, ref):
    """The same checkpoint with a window wider than the prompt: far from transformers' logits."""
    import json

    cfg_file = path / "config.json"
    conf = json.loads(cfg_file.read_text())
    (conf.get("text_config") or conf)["sliding_window"] = 4096
    cfg_file.write_text(json.dumps(conf))
    wide = load_model(path, torch.float32)
    kv = KVCache(2, 1, 2, 128, wide.cfg.head_dim, torch.float32)
    ctx = wide.make_context(torch.tensor([0]), torch.arange(90)[None], [0], 90)
    assert (wide.logits(wide(ids, ctx, kv))[0] - ref).abs().max().item() > 0.1


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_decode_steps_match_transformers_and_are_invariant(kind, tmp_path):
    """Prefill, decode and verification steps (the C kernel where available: window, soft-cap, local
    RoPE) past the window: transformers' logits, and bit-identical alone, batched, as one of T
    queries or of a prefill chunk."""
    ref_model = _make(kind, tmp_path)
    ours = load_model(tmp_path, torch.float32)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = ref_model(ids).logits[0]
    kv = KVCache(2, 4, 2, 64, ours.cfg.head_dim, torch.float32)

    def run(slots: list[int], start: int, T: int, cache: KVCache = kv) -> torch.Tensor:
        pos = torch.arange(start, start + T).expand(len(slots), T)
        ctx = ours.make_context(torch.tensor(slots), pos, slots, start + T)
        assert (ctx.mask is None) == ours.invariant_attention  # every query count: the chunk-invariant kernel
        return ours.logits(ours(ids[:, start:start + T].expand(len(slots), T), ctx, cache))

    for s in range(4):
        run([s], 0, 20)  # prefill
    steps = torch.cat([run([2], t, 1)[0] for t in range(20, 40)])  # slot 2: one token at a time
    assert (steps - ref[20:]).abs().max().item() < 1e-4
    four = run([0, 1, 3], 20, 4)  # three slots, four queries each (a verification step)
    assert (four - ref[20:24]).abs().max().item() < 1e-4
    if ours.invariant_attention:
        assert torch.equal(four[0], steps[:4]) and torch.equal(four[1], four[2])
        assert torch.equal(run([1], 20, 1)[0, 0], steps[0])
        assert torch.equal(run([3], 20, 20)[0], steps)  # a 20-query prefill chunk: the decode steps' bits
        ours.invariant_attention = False  # the torch path (no C compiler, CUDA) masks alike, on the
        torch_kv = KVCache(2, 4, 2, 64, ours.cfg.head_dim, torch.float32, kernel_layout=False)  # same K/V
        torch_kv.k.copy_(kv.k.transpose(-1, -2))  # the same blocks: keys' positions innermost
        torch_kv.v.copy_(kv.v)
        assert (run([0, 3], 20, 4, torch_kv) - ref[20:24]).abs().max().item() < 1e-4


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["llama3", "qwen2_sw", "gemma3"])
def test_rows_of_any_length_in_one_forward_have_each_rows_own_bits(kind, tmp_path):
    """One token budget: a verification row, a prompt chunk and a decode row of three slots in one
    forward (varlen rows) give every token the bits of its own row's forward and write the same
    K/V, the whole stack in one C call and layer by layer (windows and local RoPE included)."""
    _make(kind, tmp_path)
    ours = load_model(tmp_path, torch.float32)
    assert ours.chunk_invariant and kernels.library() is not None
    ids = torch.randint(0, 290, (3, 60), generator=torch.Generator().manual_seed(4))
    rows = [(0, 30, 4), (1, 20, 30), (2, 10, 1)]  # (slot, first position, tokens)

    def forward(kv: KVCache, slot: int, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)[None]
        return ours(ids[slot:slot + 1, start:start + n], ours.make_context(torch.tensor([slot]), pos, [slot], start + n),
                    kv)[0]

    for layerwise in (False, True):
        fused = ours.fused
        if layerwise:
            ours.fused = None
        try:
            alone, together = (KVCache(2, 3, 2, 128, ours.cfg.head_dim, torch.float32) for _ in range(2))
            for kv in (alone, together):
                for slot, start, _ in rows:
                    forward(kv, slot, 0, start)  # what each slot holds before
            own = torch.cat([forward(alone, *row) for row in rows])
            seg = torch.tensor([0, 4, 34, 35])
            pos = torch.cat([torch.arange(start, start + n) for _, start, n in rows])[None]
            x = torch.cat([ids[slot, start:start + n] for slot, start, n in rows])[None]
            one = ours(x, ours.make_varlen_context(torch.tensor([0, 1, 2]), pos, seg), together)[0]
        finally:
            ours.fused = fused
        assert torch.equal(one, own)
        for slot, start, n in rows:
            kv_alone, kv_together = alone.rows(slot, 0, start + n), together.rows(slot, 0, start + n)
            assert all(torch.equal(a, b) for a, b in zip(kv_alone, kv_together))


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_engine_serves_the_architecture_greedy_as_transformers_and_lossless(kind, tmp_path):
    """Through the engine (the default model's tokenizer in the folder, random weights in the
    architecture's shape): greedy tokens equal transformers' `generate`, with speculation off and at K=3."""
    import transformers as tf

    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine
    from specguide.models.default_model import prepare_default_model
    from specguide.request import Request, SamplingParams

    torch.manual_seed(0)
    common = {**COMMON, "vocab_size": 49152, "max_position_embeddings": 512}
    if kind == "qwen3":
        ref = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    elif kind.startswith("gemma"):  # a window of 6: the 11-token prompt and 24 new tokens outgrow it
        ref = _gemma(kind, common)
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


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sharded_half_precision_checkpoint_is_read_through_its_index(dtype, tmp_path, monkeypatch):
    """A bf16 / fp16 checkpoint in shards (`model.safetensors.index.json`) beside a
    `consolidated.safetensors` (as Mistral's folders have): exactly the index's shards are read, and
    the logits (fp32 compute) match transformers' on the same checkpoint."""
    import transformers as tf
    from safetensors.torch import save_file

    from specguide.models import loader

    torch.manual_seed(0)
    tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=None)).to(dtype).save_pretrained(
        tmp_path, max_shard_size="50KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64, dtype=dtype)}, str(tmp_path / "consolidated.safetensors"))
    read, load_file = [], loader.load_file
    monkeypatch.setattr(loader, "load_file", lambda f: (read.append(Path(f).name), load_file(f))[1])
    ours = load_model(tmp_path, torch.float32)
    assert sorted(read) == shards
    ref = tf.MistralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(0, 290, (1, 40), generator=torch.Generator().manual_seed(1))
    ctx = ours.make_context(torch.tensor([0]), torch.arange(40)[None], [0], 40)
    got = ours.logits(ours(ids, ctx, KVCache(2, 1, 2, 64, ours.cfg.head_dim, torch.float32)))[0]
    assert (got - ref(ids).logits[0]).abs().max().item() < 1e-4


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    import transformers as tf

    tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel .*'gpt2'.* not supported"):
        load_model(tmp_path, torch.float32)
    tf.Phi3Config(**COMMON, partial_rotary_factor=0.5).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        load_model(tmp_path, torch.float32)
    tf.GemmaConfig(**COMMON, architectures=["GemmaForCausalLM"]).save_pretrained(tmp_path)  # Gemma 1: not served
    with pytest.raises(ValueError, match="architecture GemmaForCausalLM .*'gemma'.* not supported"):
        load_model(tmp_path, torch.float32)
    tf.Gemma3TextConfig(**COMMON, use_bidirectional_attention=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(tmp_path, torch.float32)
