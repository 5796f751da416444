"""A separate small draft model sharing the target's tokenizer, with its own per-slot KV cache."""
from __future__ import annotations

import torch

from ..kv_cache import KVCache
from ..models.llama import LlamaModel
from ..scheduler import Sequence


class DraftModel:
    """Keeps a draft-model KV cache per slot in step with each sequence.

    `cached[slot]` tokens of the slot's sequence are in the draft cache. Before drafting,
    `catch_up` feeds what is missing (the prompt for a new request; nothing after a fully
    accepted step); after verification `commit` keeps only the positions whose tokens were
    accepted (the rest is dead, like the target's)."""

    def __init__(self, model: LlamaModel, max_slots: int, max_seq_len: int, K: int, chunk: int,
                 device: torch.device):
        cfg = model.cfg
        self.model = model
        self.device = device
        self.chunk = chunk
        self.kv = KVCache(cfg.num_layers, max_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                          model.embed.weight.dtype, device, spare=K)
        self.cached = [0] * max_slots
        self.owner = [-1] * max_slots  # seq_id whose tokens the slot's cache holds

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence]) -> None:
        """Feed each sequence's tokens up to (not including) its last one."""
        for s in seqs:
            if self.owner[s.slot] != s.seq_id:
                self.owner[s.slot], self.cached[s.slot] = s.seq_id, 0
            toks = s.prompt_ids + s.output_ids
            while self.cached[s.slot] < len(toks) - 1:
                a = self.cached[s.slot]
                b = min(len(toks) - 1, a + self.chunk)
                ids = torch.tensor([toks[a:b]], device=self.device)
                ctx = self.model.make_context(torch.tensor([s.slot], device=self.device),
                                              torch.arange(a, b, device=self.device)[None, :], [s.slot], b)
                self.model(ids, ctx, self.kv)
                self.cached[s.slot] = b

    def step(self, cur: torch.Tensor, ctx) -> torch.Tensor:
        """One draft step for the batch (the runner's draft loop calls it): logits [B, V]."""
        return self.model.logits(self.model(cur, ctx, self.kv)[:, -1])

    def commit(self, seq: Sequence, num_tokens_before: int, fed: int, accepted: int) -> None:
        """After verification: the cache holds the last token and the accepted drafts it was fed."""
        self.cached[seq.slot] = min(num_tokens_before + accepted, num_tokens_before - 1 + fed)
