"""Runs a trained DraftHead inside the engine step: target features per slot, the head's own
KV cache, catch-up of verified positions, then K chained draft steps."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from .. import kernels
from ..engine.kv_cache import KVCache, huge_zeros
from ..engine.scheduler import Sequence
from .draft_head import DraftHead


class HeadDrafter:
    """Keeps, per slot, the target's features f_p (written by the runner after every forward)
    and the head's KV cache, whose rows < `cached[slot]` hold real (f_p, x_{p+1}) inputs
    (`valid[slot]` of them computed for sure: the staged rows count once their step is done).

    Its cache and the features live in the target's blocks (the same table). A sequence that
    shares a prefix's blocks (Scheduler) finds their features there, and computes the head's rows
    from position 0: in a shared block it writes the bits already there (the forwards are
    chunk-invariant, and a block's key reads the token its last row needs)."""

    def __init__(self, head: DraftHead, max_slots: int, max_seq_len: int, K: int, chunk: int,
                 device: torch.device, table: Optional[torch.Tensor] = None, num_blocks: int = 0):
        cfg = head.cfg
        self.head = head
        self.device = device
        self.chunk = chunk
        self.max_drafts = K
        dtype = head.target.dtype
        # the target's block table (`table`: the engine's blocks; the same positions as its cache)
        self.kv = KVCache(1, max_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim, dtype, device, spare=K + 1,
                          table=table, num_blocks=num_blocks)
        B = KVCache.BLOCK  # [blocks * 16, H]: position p of slot s in row table[s, p // 16] * 16 + p % 16
        self.feats = huge_zeros((self.kv.num_blocks * B, cfg.hidden_size), dtype, device, touch=False)
        self.cached = [0] * max_slots
        self.valid = [0] * max_slots
        self.d2t = head.d2t
        self.max_seq_len = max_seq_len
        pin = device.type == "cuda"
        W = K + 1
        self.pos_host = torch.zeros(max_slots, W, dtype=torch.int64, pin_memory=pin)  # [B, K+1] staged rows
        self.tok_host = torch.zeros(max_slots, W, dtype=torch.int64, pin_memory=pin)
        self.last_host = torch.zeros(max_slots, dtype=torch.int64, pin_memory=pin)  # [B] index of row N-2
        self.pos, self.tok, self.last = (t.to(device) for t in (self.pos_host, self.tok_host, self.last_host))
        self.T = 1
        self.g: torch.Tensor = torch.zeros(0)
        self.catchup_s = 0.0  # host time in catch-up forwards since take_catchup_s (not the step's own cost)

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of `feats` [B, T] int64 of positions [B, T] of slots [B]."""
        B = KVCache.BLOCK
        return self.kv.table[slots[:, None], positions // B].to(torch.int64) * B + positions % B

    def _slot_rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Rows of `feats` [n] of the slot's positions [start, end)."""
        p = torch.arange(start, end, device=self.device)[None]
        return self.rows(torch.tensor([slot], device=self.device), p)[0]

    def features(self, slot: int, start: int, end: int) -> torch.Tensor:
        """The slot's target features of positions [start, end): a copy [n, H]."""
        return self.feats[self._slot_rows(slot, start, end)]

    def record(self, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Target features: hidden [B, T, H] at positions [B, T] of slots [B]."""
        at = self.rows(slots, positions)
        if not kernels.scatter_rows(self.feats, at, hidden):
            self.feats[at] = hidden.to(self.feats.dtype)

    def admit(self, slot: int, seq: Sequence) -> None:
        """A new sequence: its head rows are computed from position 0 (catch-up)."""
        self.cached[slot] = self.valid[slot] = 0

    def drop_rows(self, slot: int) -> None:
        """The slot's blocks are gone (preempted): no head rows left; its features come back with
        the target's recompute."""
        self.cached[slot] = self.valid[slot] = 0

    @torch.inference_mode()
    def prepare(self, seqs: list[Sequence], key) -> None:
        """Host: feed long new prompts in chunks, then stage each row's verified (f_p, x_{p+1})
        rows up to p = N-2 (at most K+1; captured steps pad every row to K+1)."""
        t0 = time.perf_counter()
        for s in seqs:
            # a step that failed after this point last time (and is retried) re-feeds its rows
            self.cached[s.slot] = max(0, min(self.valid[s.slot], s.num_tokens - 2))
        self._catch_up(seqs)
        rows = [list(range(self.cached[s.slot], s.num_tokens - 1)) for s in seqs]
        self.catchup_s += time.perf_counter() - t0
        T = self.max_drafts + 1 if key.captured else max(len(r) for r in rows)
        P, X, L = self.pos_host.numpy(), self.tok_host.numpy(), self.last_host.numpy()
        P[:] = self.max_seq_len + np.arange(self.max_drafts + 1)[None, :]  # padding rows: dead positions
        X[:] = 0
        L[:] = 0
        for b, (s, r) in enumerate(zip(seqs, rows)):
            # padding positions continue past N-2: speculative positions that later steps rewrite
            P[b, :T] = r + list(range(s.num_tokens - 1, s.num_tokens - 1 + T - len(r)))
            X[b, :T] = s.tokens(r[0] + 1, s.num_tokens) + [s.last_token] * (T - len(r))
            L[b] = len(r) - 1
            self.cached[s.slot] = s.num_tokens - 1
        self.T = T
        for dev, host in ((self.pos, self.pos_host), (self.tok, self.tok_host), (self.last, self.last_host)):
            dev.copy_(host, non_blocking=key.captured)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Rows more than K+1 behind (a new prompt; a sequence back from plain steps), leaving <= K+1
        rows for the step: every slot behind goes in one forward, of as many rows as the nearest of
        them has to catch up (at most `chunk`), until none is behind (after plain steps every slot is
        as far behind: one forward)."""
        while True:
            behind = [(s, s.num_tokens - 1 - self.max_drafts - 1 - self.cached[s.slot]) for s in seqs]
            behind = [(s, n) for s, n in behind if n > 0]
            if not behind:
                return
            n = min(self.chunk, min(n for _, n in behind))
            starts = [self.cached[s.slot] for s, _ in behind]
            self._run([s.slot for s, _ in behind], [list(range(a, a + n)) for a in starts],
                      [s.tokens(a + 1, a + 1 + n) for (s, _), a in zip(behind, starts)])
            for (s, _), a in zip(behind, starts):
                self.cached[s.slot] = self.valid[s.slot] = a + n

    def draft(self, i: int, cur: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, ctx) -> torch.Tensor:
        """Draft i in the step: i = 0 runs the staged rows and takes g at p = N-2; i >= 1 feeds
        (g, d_i) at position N-2+i. Logits [B, Vd] over the draft vocabulary."""
        B = cur.shape[0]
        if i == 0:
            pos, tok = self.pos[:B, : self.T], self.tok[:B, : self.T]
            g = self.head(self.feats, tok, ctx(pos, self.T - 1), self.kv, at=self.rows(slots, pos))  # [B, T, H]
            self.g = kernels.pick_rows(g, self.last[:B])
        else:
            pos = pos0[:, None] - 1 + i
            self.g = self.head(self.g[:, None], cur, ctx(pos, i), self.kv)[:, 0]
        return self.head.logits(self.g)

    def take_catchup_s(self) -> float:
        """Host seconds spent catching up rows since the last call (a prompt's, or those of the
        plain steps since the sequence last drafted): cost_aware_k leaves them out of a step's cost."""
        spent, self.catchup_s = self.catchup_s, 0.0
        return spent

    def done(self, seqs: list[Sequence], accepted: list[int], width: int) -> None:
        """The step ran: its staged rows (up to N-2) are in the head's cache."""
        for s in seqs:
            self.valid[s.slot] = self.cached[s.slot]

    def _run(self, slots: list[int], positions: list[list[int]], tokens: list[list[int]]) -> torch.Tensor:
        """Catch-up forward of verified rows (host lists, outside the step)."""
        slot_t = torch.tensor(slots, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [B, T]
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        model = self.head.target
        ctx = model.make_context(slot_t, pos, slots, max(max(p) for p in positions) + 1)
        return self.head(self.feats, ids, ctx, self.kv, at=self.rows(slot_t, pos))  # the features at [B, T]
