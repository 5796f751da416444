"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2 with QKV bias, Qwen3 with q/k norms,
Phi-3 with fused projections, Gemma 2/3: see models/gemma.py) over a per-slot KV cache.

One attention path serves prefill chunks and decode steps of 1..K+1 tokens: every query of
slot b at position p attends to the cached keys of slot b at positions <= p. Positions past a
slot's length hold stale keys that the mask hides, so rolling back is just not advancing.
Sliding-window layers (Gemma) see only the last `sliding_window` keys, in both paths.

On CPU in fp32 with the C kernels, every forward (prefill chunks of any length included) runs the
batch- and chunk-invariant attention kernel: a position's K/V and hidden state are the same bits
however the prompt was split into chunks or batched, so prefix caching can reuse any prefix
(`LlamaModel.chunk_invariant`). Elsewhere prefill uses SDPA over a mask.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels import stack
from .embedding import Q8Rows
from .linear import InvariantLinear, linear_add, make_head, prepare_linears

if TYPE_CHECKING:
    from ..engine.kv_cache import KVCache


INVARIANT_MAX_QUERIES = 16  # without `invariant_prefill`: only decode and verification steps (T <= K+1) use the kernel


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
    # Gemma (models/gemma.py; norm weights are stored as 1 + w, so every norm is a plain RMSNorm)
    act: str = "silu"  # the MLP's gate activation: silu | gelu_tanh
    sandwich_norm: bool = False  # Gemma 2/3: norms on the attention and MLP outputs too
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float = 0.0  # q.k scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # > 0: attention scores soft-capped (Gemma 2)
    final_softcap: float = 0.0  # > 0: logits soft-capped (Gemma 2)
    sliding_window: int = 0  # keys seen by a sliding layer's query (itself included)
    sliding: tuple[bool, ...] = ()  # per layer: sliding-window (local) attention

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    @property
    def key_cost(self) -> float:
        """A key's attention work against a token's other work (its projections and MLP), in FLOPs:
        how much more a token at position p costs a forward than one at 0 (Scheduler's `key_cost`)."""
        per_layer = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim \
            + self.num_heads * self.head_dim * self.hidden_size + 3 * self.hidden_size * self.intermediate_size
        return 4 * self.num_heads * self.head_dim / (2 * per_layer)  # q.k and p.v: 2 FMAs a key and head dim

    def plain_attention(self) -> ModelConfig:
        """This config with Llama's attention (full, head_dim ** -0.5, uncapped): draft heads."""
        return replace(self, attn_scale=0.0, attn_softcap=0.0, sliding_window=0, sliding=())

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        from .gemma import gemma_fields

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
            qk_norm=hf.model_type in ("qwen3", "gemma3_text"),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 8192),
            **gemma_fields(hf),
            **sliding_fields(hf),
        )


def sliding_fields(hf) -> dict:
    """Sliding-window layers: `layer_types` (Gemma 2/3, Qwen2 with use_sliding_window, Qwen3), else
    Mistral's `sliding_window` on every layer; {} when no layer slides."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    types = getattr(hf, "layer_types", None)
    if types:
        sliding = tuple(t == "sliding_attention" for t in types)
    else:
        sliding = (hf.model_type == "mistral",) * hf.num_hidden_layers
    return {"sliding_window": window, "sliding": sliding} if window and any(sliding) else {}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool = False):
        super().__init__()
        self.cfg = cfg
        self.sliding = sliding  # local layer: sliding window, local RoPE tables
        self.index = 0  # its place in the stack (LlamaModel sets it): its adapters' layer
        self.window = cfg.sliding_window if sliding else 0
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.qkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)  # fused q|k|v
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.o = nn.Linear(q, cfg.hidden_size, bias=False)
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden_size))  # before the MLP
        if cfg.sandwich_norm:
            self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size))
            self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # fused gate|up
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: "AttnContext",
                k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lora=None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; this layer's paged caches [blocks, kvh, ..], block
        table [slots, blocks_per_seq] (KVCache); `lora`: the rows' adapters (models/lora.py LoRARows)."""
        cfg = self.cfg
        B, T, _ = x.shape
        nh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv_proj(x, lora)  # [B, T, nh+2kvh, hd]
        if ctx.mask is None:  # one batch- and chunk-invariant C call (RoPE, cache write, attention)
            attn = kernels.rope_attention_f32(qkv, cos, sin, k_cache, v_cache, table, ctx.slots, ctx.positions, nh,
                                              cfg.scale, self.window, cfg.attn_softcap, ctx.seg)
        else:
            assert ctx.seg is None, "rows of any length need the C kernel (make_varlen_context)"
            if k_cache.shape[-2] != kernels.KEY_BLOCK or k_cache.shape[-1] != hd:
                raise ValueError("the torch attention path needs a KV cache in torch's layout "
                                 "(KVCache(..., kernel_layout=False))")
            qk = apply_rope(qkv[:, :, : nh + kvh], cos, sin)  # [B, T, nh+kvh, hd]
            q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + kvh:]
            ctx.write(k_cache, table, k)
            ctx.write(v_cache, table, v)
            keys, values = ctx.read(k_cache, table), ctx.read(v_cache, table)  # [B, kvh, L, hd]
            mask = ctx.window_mask if self.window else ctx.mask
            attn = attention(q.transpose(1, 2), keys, values, mask, cfg).transpose(1, 2)  # [B, T, nh, hd]
        return self.out_mlp(x, attn.reshape(B, T, nh * hd), lora)

    def weights(self) -> Optional[stack.LayerWeights]:
        """This layer as the C stack reads it (kernels/stack.py), or None when a linear is not the C
        kernels' (other dtypes, CUDA) or has a bias the C stack does not add."""
        lins = (self.qkv, self.o, self.gate_up, self.down)
        if not all(isinstance(lin, InvariantLinear) for lin in lins) or any(lin.bias is not None for lin in lins[1:]):
            return None
        opt = lambda name: getattr(self, name, None)  # noqa: E731
        return stack.LayerWeights(
            *(stack.Linear(lin.packed, lin.scale, lin.weight_dtype) for lin in lins),
            in_norm=self.input_norm.detach(), post_norm=self.post_norm.detach(), local=self.sliding,
            qkv_bias=None if self.qkv.bias is None else self.qkv.bias.contiguous(),
            **{name: opt(name).detach() for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
               if opt(name) is not None})

    def qkv_proj(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [..., T, hidden] -> fused q|k|v heads [..., T, nh+2kvh, hd] (before RoPE)."""
        cfg = self.cfg
        xn = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(xn)
        if lora is not None:
            qkv = lora.add(self.index, 0, xn, qkv)
        qkv = qkv.view(*x.shape[:-1], cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # per head, before RoPE (Qwen3)
            nh, kvh = cfg.num_heads, cfg.num_kv_heads
            qkv = torch.cat([rms_norm(qkv[..., :nh, :], self.q_norm, cfg.rms_norm_eps),
                             rms_norm(qkv[..., nh:nh + kvh, :], self.k_norm, cfg.rms_norm_eps), qkv[..., nh + kvh:, :]],
                            dim=-2)
        return qkv

    def out_mlp(self, x: torch.Tensor, attn: torch.Tensor, lora=None) -> torch.Tensor:
        """The layer after attention: x + o(attn), then the gated MLP with its residual (Gemma 2/3:
        each branch normed before its residual add); `lora` adds the rows' adapters as ops.c does."""
        eps = self.cfg.rms_norm_eps
        add = (lambda p, a, y: y) if lora is None else (lambda p, a, y: lora.add(self.index, p, a, y))  # noqa: E731
        if self.cfg.sandwich_norm:
            x = x + rms_norm(add(1, attn, self.o(attn)), self.attn_out_norm, eps)
        else:
            x = add(1, attn, linear_add(self.o, attn, x))
        xn = rms_norm(x, self.post_norm, eps)
        gate, up = add(2, xn, self.gate_up(xn)).chunk(2, dim=-1)
        h = (F.gelu(gate, approximate="tanh") if self.cfg.act == "gelu_tanh" else F.silu(gate)) * up
        if self.cfg.sandwich_norm:
            return x + rms_norm(add(3, h, self.down(h)), self.mlp_out_norm, eps)
        return add(3, h, linear_add(self.down, h, x))


@dataclass
class AttnContext:
    """Per-forward attention metadata shared by all layers."""

    slots: torch.Tensor  # [B] int64 cache rows
    positions: torch.Tensor  # [B, T] int64 absolute positions of the queries
    mask: Optional[torch.Tensor]  # [B, 1, T, L] bool: key position <= query position; None: C kernel
    length: int  # L: keys attended (max position + 1 over the batch)
    slot_range: Optional[tuple[int, int]]  # (first, end) when slots are consecutive: their table rows a slice
    window_mask: torch.Tensor | None = None  # mask, and query position - key position < window
    seg: torch.Tensor | None = None  # varlen [B + 1] int64: row b is tokens seg[b] .. of positions [1, N] (C kernel)

    def write(self, cache: torch.Tensor, table: torch.Tensor, x: torch.Tensor) -> None:
        # cache [blocks, kvh, 16, hd] <- x [B, T, kvh, hd] at (slot b, position positions[b, t])
        B = cache.shape[2]
        cache[table[self.slots[:, None], self.positions // B], :, self.positions % B] = x

    def read(self, cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Positions [0, length) of every row: [B, kvh, length, hd] (a gather of their blocks)."""
        B = cache.shape[2]
        nb = -(-self.length // B)
        rows = (table[self.slot_range[0]: self.slot_range[1], :nb] if self.slot_range is not None
                else table.index_select(0, self.slots)[:, :nb])  # [B, nb]
        x = cache[rows]  # [B, nb, kvh, 16, hd]
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], nb * B, x.shape[4])[:, :, : self.length]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """q [B, nh, T, hd], k / v [B, kvh, L, hd], mask [B, 1, T, L] -> [B, nh, T, hd] (the C kernel's math)."""
    if not cfg.attn_softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
                                              scale=cfg.attn_scale or None)
    g = q.shape[1] // k.shape[1]  # soft-capped scores (Gemma 2): SDPA has no such option
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * cfg.scale
    s = (torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap).masked_fill(~mask, float("-inf"))
    return s.softmax(-1, dtype=torch.float32).to(q.dtype) @ v.repeat_interleave(g, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x * rsqrt(mean(x^2) + eps) * weight, one fused op (bit-identical to transformers' in fp32)
    return F.rms_norm(x, weight.shape, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x [B, T, H, hd]; cos/sin [B, T, 1, hd]; HF's x*cos + rotate_half(x)*sin with
    # rotate_half(x) = cat(-x2, x1) = roll(x, hd/2) * [-1.., +1..] folded into sin_signed
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class LlamaModel(nn.Module):
    """Decoder stack + final norm + LM head. `forward` returns hidden states; `logits` projects them."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 local_rope: tuple[torch.Tensor, float] | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        sliding = cfg.sliding or (False,) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, sliding[i]) for i in range(cfg.num_layers))
        for i, layer in enumerate(self.layers):
            layer.index = i
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        # Gemma 3: sliding layers' own RoPE (inv_freq, scaling); None: the global tables
        self.register_buffer("inv_freq_local", None if local_rope is None else local_rope[0].float(), persistent=False)
        self.local_scaling = 1.0 if local_rope is None else local_rope[1]
        self.embed_scale = cfg.embed_scale  # rounded to the model dtype by finalize()
        self._head_weight: Optional[torch.Tensor] = None  # an untied head's weight (finalize)
        self.invariant_attention = False  # set by finalize() when the C kernel can serve this model
        # prefill chunks too (as fast as SDPA at 256-1024 tokens: bench/bench_prefill_attention.py); False:
        # SDPA for T > INVARIANT_MAX_QUERIES (benchmarks only: prefix reuse then stops at whole chunks)
        self.invariant_prefill = True
        self.fused: Optional[stack.FusedStack] = None  # every layer in one C call (set by finalize)
        self.lora = None  # the LoRA adapters of its cache rows (models/lora.py LoRABank), when served
        self._rope_cache: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope_tables(self, max_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [max_len, hd] in the model dtype, computed once in fp32 like transformers
        (`local`: the sliding layers' tables when they have their own)."""
        local = local and self.inv_freq_local is not None
        cached = self._rope_cache.get(local)
        if cached is None or cached[0].shape[0] < max_len:
            inv_freq, scaling = (self.inv_freq_local, self.local_scaling) if local else (self.inv_freq,
                                                                                         self.attention_scaling)
            pos = torch.arange(max_len, device=inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = self.dtype
            sin = emb.sin() * scaling
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._rope_cache[local] = cached = ((emb.cos() * scaling).to(dtype), sin_signed.to(dtype))
        return cached

    def rope(self, ctx: AttnContext, max_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin for a forward: whole tables [P, hd] for the C kernel (it indexes them
        itself), else gathered at the query positions [B, T, 1, hd]."""
        cos, sin = self.rope_tables(max_len, local)
        if ctx.mask is not None:
            cos, sin = cos[ctx.positions].unsqueeze(2), sin[ctx.positions].unsqueeze(2)
        return cos, sin

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (its embedding's rows)."""
        return self.embed.weight.dtype if isinstance(self.embed, nn.Embedding) else self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the LM head's weight [len(ids), hidden] (draft heads share them)."""
        return self.embed(ids) if self._head_weight is None else self._head_weight[ids]

    @property
    def chunk_invariant(self) -> bool:
        """Every forward runs the invariant kernels: a position's K/V do not depend on the chunk split,
        the batch or the query count (decode steps included)."""
        return self.invariant_attention and self.invariant_prefill

    def make_context(self, slots: torch.Tensor, positions: torch.Tensor, slot_list: Optional[list[int]],
                     length: int) -> AttnContext:
        if self.invariant_attention and (self.invariant_prefill or positions.shape[1] <= INVARIANT_MAX_QUERIES):
            return AttnContext(slots, positions, None, length, None)
        kpos = torch.arange(length, device=positions.device)[None, None, :]
        mask = (kpos <= positions[:, :, None]).unsqueeze(1)
        window = None
        if self.cfg.sliding_window and any(self.cfg.sliding):  # the C kernel's window: the last W keys
            window = mask & (kpos > positions[:, :, None] - self.cfg.sliding_window).unsqueeze(1)
        consecutive = slot_list is not None and slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
        rng = (slot_list[0], slot_list[0] + len(slot_list)) if consecutive else None
        return AttnContext(slots, positions, mask, length, rng, window)

    def make_varlen_context(self, slots: torch.Tensor, positions: torch.Tensor, seg: torch.Tensor) -> AttnContext:
        """Rows of any length in one forward (prompt chunks beside decode rows): tokens [1, N] at
        positions [1, N], row b (cache row slots[b]) is tokens seg[b] .. seg[b + 1] - 1; each token's
        result is the bits it has in its own row's forward. Only where `chunk_invariant`."""
        assert self.chunk_invariant, "rows of any length need the C attention kernel for prompts"
        return AttnContext(slots, positions, None, 0, None, seg=seg)

    def forward(self, input_ids: torch.Tensor, ctx: AttnContext, kv: KVCache,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """input_ids [B, T] at ctx.positions -> hidden [B, T, hidden] after the final norm.

        `num_layers` < all runs only the first layers (early-exit drafting shares their KV)."""
        tables = {False: self.rope(ctx, kv.max_seq_len)}
        tables[True] = self.rope(ctx, kv.max_seq_len, True) if self.inv_freq_local is not None else tables[False]
        x = self.embed(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.fused is not None and ctx.mask is None:  # the same kernels, one C call
            return self.fused(x, (*tables[False], *tables[True]), kv.k, kv.v, kv.table, ctx.slots, ctx.positions,
                              num_layers or 0, final_norm=self.norm, in_place=True, seg=ctx.seg,  # x: a copy
                              lora=None if self.lora is None else self.lora.c_struct())
        lora = None if self.lora is None else self.lora.rows(ctx.slots, input_ids.shape[1])
        for i, layer in enumerate(self.layers[: num_layers or len(self.layers)]):
            x = layer(x, *tables[layer.sliding], ctx, kv.k[i], kv.v[i], kv.table, lora)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def finalize(self, weight_dtype: str = "float32", integer_dot: bool = False) -> None:
        """After weights are loaded and placed: build the LM head and pack CPU linears, their
        weights held in `weight_dtype` (bf16 / int8: weight-only quantization, CPU kernels only);
        `integer_dot`: block-format weights times int8 activations (models/linear.py). Linears packed
        already (read from the packed-weights cache: packed_cache.install) stay as they are."""
        tied = self.lm_head is None
        w = self.embed.weight if tied else self.lm_head.weight
        self._head_weight = None if tied else w  # [vocab, hidden]: draft heads share its rows (head_rows)
        self.weight_dtype = weight_dtype
        self.integer_dot = integer_dot
        if not isinstance(getattr(self, "head", None), InvariantLinear):
            self.head = make_head(w, weight_dtype, integer_dot)
        self.lm_head = None
        if w.device.type == "cpu":
            prepare_linears(self.layers, weight_dtype, integer_dot)
        if w.device.type == "cpu" and kernels.library() is not None:  # a GGUF's Q8_0 embedding: 28 of 108 MiB
            self.embed = Q8Rows.of(w if tied else self.embed.weight, self.head if tied else None) or self.embed
        self.invariant_attention = kernels.serves_attention(w.device, w.dtype, self.cfg.head_dim)
        self.fused = fused_stack(self.layers, self.cfg) if self.invariant_attention else None
        # as transformers: the scale in the model dtype (sqrt(hidden) is rounded in bf16)
        self.embed_scale = float(torch.tensor(self.cfg.embed_scale).to(w.dtype))

    def logits(self, hidden: torch.Tensor, tiles: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [..., hidden] -> fp32 logits [..., vocab] (soft-capped: Gemma 2). `tiles`: only those
        output tiles of a C-kernel head (`sparse_head`); the other logits are -inf (-cap soft-capped).
        `out`: [rows, vocab] fp32 a C-kernel head writes into (a caller's static buffer; others ignore it)."""
        if not isinstance(self.head, InvariantLinear):
            out = None
        if tiles is not None:
            logits = self.head.forward_tiles(hidden, tiles, out)
        else:
            logits = self.head(hidden).float() if out is None else self.head(hidden, out=out)
        cap = self.cfg.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits


def sparse_head(model: "LlamaModel") -> bool:
    """Whether `model.logits` can compute a subset of output tiles (a C-kernel LM head)."""
    return hasattr(model.head, "forward_tiles") and getattr(model.head, "bias", None) is None


def fused_stack(layers: list[DecoderLayer], cfg: ModelConfig) -> Optional[stack.FusedStack]:
    """`layers` as one C call (kernels/stack.py), or None when one of them cannot be."""
    weights = [layer.weights() for layer in layers]
    if not weights or any(w is None for w in weights) or cfg.act not in stack.ACTS:
        return None
    return stack.FusedStack(weights, stack.Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                                 cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.scale,
                                                 cfg.sliding_window, cfg.attn_softcap, cfg.act))
