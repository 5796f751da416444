"""Runs a trained DraftHead inside the engine step: target features per slot, the head's own
KV cache, catch-up of verified positions, then K chained draft steps."""
from __future__ import annotations

import torch

from ..kv_cache import KVCache
from ..scheduler import Sequence
from .draft_head import DraftHead


class HeadDrafter:
    """Keeps, per slot, the target's features f_p (written by the runner after every forward)
    and the head's KV cache, whose rows < `cached[slot]` hold real (f_p, x_{p+1}) inputs."""

    def __init__(self, head: DraftHead, max_slots: int, max_seq_len: int, K: int, chunk: int,
                 device: torch.device):
        cfg = head.cfg
        self.head = head
        self.device = device
        self.chunk = chunk
        self.K = K
        dtype = head.target.embed.weight.dtype
        self.kv = KVCache(1, max_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype, device, spare=K + 1)
        self.feats = torch.zeros(max_slots, max_seq_len + K + 1, cfg.hidden_size, dtype=dtype, device=device)
        self.cached = [0] * max_slots
        self.owner = [-1] * max_slots  # seq_id whose features/KV the slot holds
        self.d2t = head.d2t

    def record(self, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Target features: hidden [B, T, H] at positions [B, T] of slots [B]."""
        self.feats[slots[:, None], positions] = hidden.to(self.feats.dtype)

    def reset(self, seq: Sequence) -> None:
        self.owner[seq.slot], self.cached[seq.slot] = seq.seq_id, 0

    @torch.inference_mode()
    def first(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each slot's verified (f_p, x_{p+1}) rows up to p = N-2 (N = tokens so far);
        returns g at p = N-2 for each sequence [B, H] (its logits give the first draft)."""
        rows: list[list[int]] = []
        history: list[list[int]] = []
        for s in seqs:
            if self.owner[s.slot] != s.seq_id:
                self.reset(s)
            # a step that failed after this point last time (and is retried) re-feeds row N-2
            self.cached[s.slot] = max(0, min(self.cached[s.slot], s.num_tokens - 2))
            toks = s.prompt_ids + s.output_ids
            history.append(toks)
            while (left := s.num_tokens - 1 - self.cached[s.slot]) > self.K + 1:
                a = self.cached[s.slot]  # a new prompt: chunks of its own, leaving <= K+1 rows for the batch
                n = min(self.chunk, left - self.K - 1)
                self._run([s.slot], [list(range(a, a + n))], [toks[a + 1: a + 1 + n]])
                self.cached[s.slot] = a + n
            rows.append(list(range(self.cached[s.slot], s.num_tokens - 1)))
        T = max(len(r) for r in rows)
        positions, tokens = [], []
        for s, r, toks in zip(seqs, rows, history):
            # padding rows continue past N-2: speculative positions that later steps rewrite
            positions.append(r + list(range(s.num_tokens - 1, s.num_tokens - 1 + T - len(r))))
            tokens.append(toks[r[0] + 1: s.num_tokens] + [s.last_token] * (T - len(r)))
        g = self._run([s.slot for s in seqs], positions, tokens)  # [B, T, H]
        last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
        for s in seqs:
            self.cached[s.slot] = s.num_tokens - 1
        return g[torch.arange(len(seqs), device=self.device), last]

    @torch.inference_mode()
    def next(self, seqs: list[Sequence], g: torch.Tensor, tokens: list[int], i: int) -> torch.Tensor:
        """Draft step i >= 1: (g, d_i) at position N-2+i -> the next g [B, H]."""
        slots = [s.slot for s in seqs]
        positions = [[s.num_tokens - 2 + i] for s in seqs]
        return self._run(slots, positions, [[t] for t in tokens], feats=g[:, None])[:, 0]

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, Vd] over the draft vocabulary."""
        return self.head.logits(g)

    def _run(self, slots: list[int], positions: list[list[int]], tokens: list[list[int]],
             feats: torch.Tensor | None = None) -> torch.Tensor:
        slot_t = torch.tensor(slots, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [B, T]
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        if feats is None:
            feats = self.feats[slot_t[:, None], pos]  # [B, T, H]
        model = self.head.target
        ctx = model.make_context(slot_t, pos, slots, max(max(p) for p in positions) + 1)
        return self.head(feats, ids, ctx, self.kv)
