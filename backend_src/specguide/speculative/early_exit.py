"""Early-exit drafting: the target's first `layers` layers + final norm + LM head (their KV is the
target's own: the verification forward rewrites those rows)."""
from __future__ import annotations

from typing import Optional

import torch

from ..engine.kv_cache import KVCache
from ..models.llama import LlamaModel
from ..engine.scheduler import Sequence


class EarlyExitDrafter:
    """A step drafter (step.Drafter) over the target's first layers."""

    d2t: Optional[torch.Tensor] = None

    def __init__(self, model: LlamaModel, kv: KVCache, layers: int):
        self.model, self.kv, self.layers = model, kv, min(layers, model.cfg.num_layers)

    def prepare(self, seqs: list[Sequence], key) -> None:
        pass

    def draft(self, i: int, cur: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, ctx) -> torch.Tensor:
        m = self.model
        return m.logits(m(cur, ctx(pos0[:, None] + i, i), self.kv, num_layers=self.layers)[:, -1])

    def done(self, seqs: list[Sequence], accepted: list[int], width: int) -> None:
        pass
