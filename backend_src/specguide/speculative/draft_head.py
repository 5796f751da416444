"""EAGLE-style draft head: one decoder layer over [target feature ; token embedding] that feeds
(a pruned slice of) the target's own LM head.

Notation: f_p is the target's final-normed hidden state at position p (it predicts x_{p+1}).
The head at position p reads (f_p, x_{p+1}) and returns g_p, an estimate of f_{p+1}; its logits
predict x_{p+2}. Drafting chains it: (f_{N-2}, x_{N-1}) -> d_1, then (g, d_1) -> d_2, ...
Its KV cache rows hold real features up to the last verified position; rows past it are
speculative and rewritten at the next step (like the target's).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .. import kernels
from ..models.embedding import Q8Rows
from ..models.linear import invariant_available, make_head, prepare_linears
from ..models.llama import AttnContext, DecoderLayer, LlamaModel, ModelConfig, fused_stack, rms_norm
from ..engine.kv_cache import KVCache
from ..util.paths import cache_dir

FORMAT_VERSION = 1


class DraftHead(nn.Module):
    """fc([f ; norm(embed(x))]) -> one Llama decoder layer -> norm -> pruned shared LM head."""

    def __init__(self, cfg: ModelConfig, d2t: torch.Tensor):
        super().__init__()
        self.cfg = cfg = cfg.plain_attention()  # full, uncapped attention: what train_head computes
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(H))
        self.layer = DecoderLayer(cfg)
        self.norm = nn.Parameter(torch.ones(H))
        self.register_buffer("d2t", d2t.to(torch.int64))  # [Vd]: draft id -> target id
        self.target: Optional[LlamaModel] = None  # embedding, RoPE tables, LM head rows (not saved)
        self.lm: Optional[nn.Module] = None
        self.fused = None  # the layer as one C call (kernels/stack.py), set by attach

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    def attach(self, target: LlamaModel, pack: bool = True, weight_dtype: str = "") -> "DraftHead":
        """Share the target's embedding and the d2t rows of its LM head; pack CPU linears, held
        in `weight_dtype` where the C kernels run ("" or elsewhere: the target's)."""
        object.__setattr__(self, "target", target)  # not a submodule: its weights are not ours
        w = target.head_rows(self.d2t.to(target.device)).detach()  # [Vd, H]
        wd = getattr(target, "weight_dtype", "float32")
        if weight_dtype and invariant_available(w):
            wd = weight_dtype  # NOTE: drafts never change the output (verification decides), only acceptance
        idot = getattr(target, "integer_dot", False)  # block formats: int8 activations, as the target's
        self.lm = make_head(w.contiguous(), wd, idot) if pack else _frozen_linear(w)
        if pack:
            prepare_linears(self, wd, idot)
        self.fused = fused_stack([self.layer], self.cfg) if pack and target.invariant_attention else None
        return self

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, ctx: AttnContext, kv: KVCache,
                at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """feats [B, T, H] (f or g), tokens [B, T] (the next tokens) at ctx.positions -> g [B, T, H].
        `at` [B, T]: feats is a store [R, H] read at those rows."""
        t, c_path = self.target, self.fused is not None and ctx.mask is None
        table = (t.embed.q, t.embed.d) if isinstance(t.embed, Q8Rows) else t.embed.weight
        x = kernels.head_inputs(feats, table, tokens, self.embed_norm, self.cfg.rms_norm_eps, at) if c_path else None
        if x is None:
            if at is not None:
                feats = feats[at]
            e = (kernels.rms_norm if c_path else rms_norm)(t.embed(tokens), self.embed_norm, self.cfg.rms_norm_eps)
            x = torch.cat([feats.to(e.dtype), e], dim=-1)
        x = self.fc(x)
        cos, sin = t.rope(ctx, kv.max_seq_len)
        if c_path:
            return self.fused(x, (cos, sin, cos, sin), kv.k, kv.v, kv.table, ctx.slots, ctx.positions,
                              final_norm=self.norm, in_place=True)  # x: fc's output
        x = self.layer(x, cos, sin, ctx, kv.k[0], kv.v[0], kv.table)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., H] -> fp32 logits over the draft vocabulary [..., Vd]."""
        return self.lm(g).float()

    # ---- persistence ------------------------------------------------------------------------
    def save(self, path: Path, meta: dict) -> None:
        """Weights (fc, norms, layer), d2t and the target's config; the LM head is not saved."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"version": FORMAT_VERSION, "config": asdict(self.cfg), "state": self.state_dict(),
                    "meta": json.loads(json.dumps(meta))}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, target: LlamaModel, weight_dtype: str = "") -> "DraftHead":
        """Load a saved head for `target` (checks that the shapes match) and attach it (`attach`)."""
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: draft head format {blob.get('version')} (expected {FORMAT_VERSION})")
        cfg = ModelConfig(**blob["config"])
        tc = target.cfg
        if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"{path}: trained for hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, "
                             f"the target has {tc.hidden_size} / {tc.vocab_size}")
        head = cls(cfg, blob["state"]["d2t"])
        head.load_state_dict(blob["state"], strict=True)
        dtype, device = target.dtype, target.device
        head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)  # d2t stays int64
        head.meta = blob.get("meta", {})
        return head.attach(target, weight_dtype=weight_dtype)


def _frozen_linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def default_head_path(model_dir: Path) -> Path:
    """Where the trained head of a model lives: the model cache, under the folder's name and a hash
    of its absolute path (two checkpoints in folders of one name, `/models/a/hf` and `/models/b/hf`,
    get a head each)."""
    folder = Path(model_dir).resolve()
    key = hashlib.sha1(str(folder).encode()).hexdigest()[:8]
    return cache_dir() / "draft_heads" / f"{folder.name}-{key}.pt"
