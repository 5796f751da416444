"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2 with QKV bias, Qwen3 with q/k norms,
Phi-3 with fused projections) over a per-slot KV cache.

One attention path serves prefill chunks and decode steps of 1..K+1 tokens: every query of
slot b at position p attends to the cached keys of slot b at positions <= p. Positions past a
slot's length hold stale keys that the mask hides, so rolling back is just not advancing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kv_cache import KVCache
from .linear import linear_add, make_head, prepare_linears


INVARIANT_MAX_QUERIES = 16  # decode and verification steps (T <= K+1) use the invariant kernel


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        heads = hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
            qk_norm=hf.model_type == "qwen3",
            max_position_embeddings=getattr(hf, "max_position_embeddings", 8192),
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)  # fused q|k|v
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: "AttnContext",
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv_proj(x)  # [B, T, nh+2kvh, hd]
        if ctx.mask is None:  # decode-sized: one batch-invariant C call (RoPE, cache write, attention)
            attn = kernels.rope_attention_f32(qkv, cos, sin, k_cache, v_cache, ctx.slots, ctx.positions, nh)
        else:
            qk = apply_rope(qkv[:, :, : nh + kvh], cos, sin)  # [B, T, nh+kvh, hd]
            q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + kvh:]
            ctx.write(k_cache, k)
            ctx.write(v_cache, v)
            keys, values = ctx.read(k_cache), ctx.read(v_cache)  # [B, kvh, L, hd]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=ctx.mask,
                                                  enable_gqa=nh != kvh).transpose(1, 2)  # [B, T, nh, hd]
        return self.out_mlp(x, attn.reshape(B, T, nh * hd))

    def qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, hidden] -> fused q|k|v heads [..., T, nh+2kvh, hd] (before RoPE)."""
        cfg = self.cfg
        qkv = self.qkv(rms_norm(x, self.input_norm, cfg.rms_norm_eps))
        qkv = qkv.view(*x.shape[:-1], cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # per head, before RoPE (Qwen3)
            nh, kvh = cfg.num_heads, cfg.num_kv_heads
            qkv = torch.cat([rms_norm(qkv[..., :nh, :], self.q_norm, cfg.rms_norm_eps),
                             rms_norm(qkv[..., nh:nh + kvh, :], self.k_norm, cfg.rms_norm_eps), qkv[..., nh + kvh:, :]],
                            dim=-2)
        return qkv

    def out_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x + o(attn), then the gated MLP with its residual."""
        x = linear_add(self.o, attn, x)
        h = rms_norm(x, self.post_norm, self.cfg.rms_norm_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return linear_add(self.down, F.silu(gate) * up, x)


@dataclass
class AttnContext:
    """Per-forward attention metadata shared by all layers."""

    slots: torch.Tensor  # [B] int64 cache rows
    positions: torch.Tensor  # [B, T] int64 absolute positions of the queries
    mask: Optional[torch.Tensor]  # [B, 1, T, L] bool: key position <= query position; None: C kernel
    length: int  # L: keys attended (max position + 1 over the batch)
    slot_range: Optional[tuple[int, int]]  # (first, end) when slots are consecutive: views, no gather

    def write(self, cache: torch.Tensor, x: torch.Tensor) -> None:
        # cache [slots, kvh, S, hd] <- x [B, T, kvh, hd] at (slot b, position positions[b, t])
        cache[self.slots[:, None], :, self.positions] = x

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        if self.slot_range is not None:
            return cache[self.slot_range[0]: self.slot_range[1], :, : self.length]
        return cache.index_select(0, self.slots)[:, :, : self.length]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x * rsqrt(mean(x^2) + eps) * weight, one fused op (bit-identical to transformers' in fp32)
    return F.rms_norm(x, weight.shape, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, hd]; cos/sin [B, T, 1, hd]; HF's x*cos + rotate_half(x)*sin with
    # rotate_half(x) = cat(-x2, x1) = roll(x, hd/2) * [-1.., +1..] folded into sin_signed
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class LlamaModel(nn.Module):
    """Decoder stack + final norm + LM head. `forward` returns hidden states; `logits` projects them."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        self.invariant_attention = False  # set by finalize() when the C kernel can serve this model
        self._rope_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [max_len, hd] in the model dtype, computed once in fp32 like transformers."""
        if self._rope_cache is None or self._rope_cache[0].shape[0] < max_len:
            pos = torch.arange(max_len, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = self.embed.weight.dtype
            sin = emb.sin() * self.attention_scaling
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._rope_cache = ((emb.cos() * self.attention_scaling).to(dtype), sin_signed.to(dtype))
        return self._rope_cache

    def rope(self, ctx: AttnContext, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin for a forward: whole tables [P, hd] for the C kernel (it indexes them
        itself), else gathered at the query positions [B, T, 1, hd]."""
        cos, sin = self.rope_tables(max_len)
        if ctx.mask is not None:
            cos, sin = cos[ctx.positions].unsqueeze(2), sin[ctx.positions].unsqueeze(2)
        return cos, sin

    def make_context(self, slots: torch.Tensor, positions: torch.Tensor, slot_list: Optional[list[int]],
                     length: int) -> AttnContext:
        if self.invariant_attention and positions.shape[1] <= INVARIANT_MAX_QUERIES:
            return AttnContext(slots, positions, None, length, None)
        kpos = torch.arange(length, device=positions.device)
        mask = (kpos[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        consecutive = slot_list is not None and slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        rng = (slot_list[0], slot_list[0] + len(slot_list)) if consecutive else None
        return AttnContext(slots, positions, mask, length, rng)

    def forward(self, input_ids: torch.Tensor, ctx: AttnContext, kv: KVCache,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """input_ids [B, T] at ctx.positions -> hidden [B, T, hidden] after the final norm.

        `num_layers` < all runs only the first layers (early-exit drafting shares their KV)."""
        cos, sin = self.rope(ctx, kv.max_seq_len)
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers[: num_layers or len(self.layers)]):
            x = layer(x, cos, sin, ctx, kv.k[i], kv.v[i])
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def finalize(self, weight_dtype: str = "float32") -> None:
        """After weights are loaded and placed: build the LM head and pack CPU linears, their
        weights held in `weight_dtype` (bf16 / int8: weight-only quantization, CPU kernels only)."""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        self.head_weight = w  # [vocab, hidden]: kept for draft heads that share (rows of) the LM head
        self.weight_dtype = weight_dtype
        self.head = make_head(w, weight_dtype)
        self.lm_head = None
        if w.device.type == "cpu":
            prepare_linears(self.layers, weight_dtype)
        self.invariant_attention = (w.device.type == "cpu" and w.dtype == torch.float32
                                    and self.cfg.head_dim % 16 == 0 and kernels.library() is not None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> fp32 logits [..., vocab]."""
        return self.head(hidden).float()
