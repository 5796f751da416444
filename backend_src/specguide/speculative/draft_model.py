"""A separate small draft model sharing the target's tokenizer, with its own per-slot KV cache."""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..engine.kv_cache import KVCache
from ..models.llama import LlamaModel
from ..engine.scheduler import Sequence


class DraftModel:
    """Keeps a draft-model KV cache per slot in step with each sequence.

    `cached[slot]` tokens of the slot's sequence are in the draft cache. Before drafting,
    `catch_up` feeds what is missing (the prompt for a new request; nothing after a fully
    accepted step); after verification `done` keeps only the positions whose tokens were
    accepted (the rest is dead, like the target's).

    Its cache lives in the target's blocks (the same table). A sequence that shares a prefix's
    blocks (Scheduler) computes its draft rows from position 0: in a shared block it writes the
    bits already there (the forwards are chunk-invariant)."""

    def __init__(self, model: LlamaModel, max_slots: int, max_seq_len: int, K: int, chunk: int,
                 device: torch.device, store: Optional[torch.dtype] = None, table: Optional[torch.Tensor] = None,
                 num_blocks: int = 0):
        cfg = model.cfg
        self.model = model
        self.device = device
        self.chunk = chunk
        # the target's block table (`table`: the engine's blocks, the same positions as its cache)
        self.kv = KVCache(cfg.num_layers, max_slots, cfg.num_kv_heads, max_seq_len, cfg.head_dim,
                          model.dtype, device, spare=K + 1, store=store, table=table, num_blocks=num_blocks)
        self.cached = [0] * max_slots
        self.catchup_s = 0.0  # host time in catch_up since take_catchup_s

    d2t = None

    def admit(self, slot: int, seq: Sequence) -> None:
        """A new sequence: its draft rows are computed from position 0 (catch-up)."""
        self.cached[slot] = 0

    def drop_rows(self, slot: int) -> None:
        """The slot's blocks are gone (preempted): refilled from position 0."""
        self.cached[slot] = 0

    def prepare(self, seqs: list[Sequence], key) -> None:
        t0 = time.perf_counter()
        self.catch_up(seqs)
        self.catchup_s += time.perf_counter() - t0

    def take_catchup_s(self) -> float:
        """Host seconds spent in catch_up since the last call (cost_aware_k leaves them out of a step's cost)."""
        spent, self.catchup_s = self.catchup_s, 0.0
        return spent

    @torch.inference_mode()
    def catch_up(self, seqs: list[Sequence]) -> None:
        """Feed each sequence's tokens up to (not including) its last one. With chunk-invariant
        forwards every sequence behind goes in one forward of rows of any length, at most `chunk`
        tokens in all (after a step that accepted every draft: the bonus token of each row); else
        one forward per sequence and chunk."""
        while rows := [(s, self.cached[s.slot]) for s in seqs if self.cached[s.slot] < s.num_tokens - 1]:
            if not self.model.chunk_invariant:
                for s, a in rows:
                    self._feed([(s, a, min(s.num_tokens - 1, a + self.chunk))])
                continue
            batch, left = [], self.chunk
            for s, a in rows:
                if left <= 0:
                    break
                b = min(s.num_tokens - 1, a + left)
                batch.append((s, a, b))
                left -= b - a
            self._feed(batch)

    def _feed(self, rows: list[tuple[Sequence, int, int]]) -> None:
        """One forward of positions [a, b) of each (sequence, a, b) into the draft cache."""
        dev = self.device
        slots = torch.tensor([s.slot for s, _, _ in rows], device=dev)
        if len(rows) == 1:
            s, a, b = rows[0]
            ids = torch.tensor([s.tokens(a, b)], device=dev)
            ctx = self.model.make_context(slots, torch.arange(a, b, device=dev)[None, :], [s.slot], b)
        else:
            ids = torch.tensor([[t for s, a, b in rows for t in s.tokens(a, b)]], device=dev)
            positions = torch.tensor([[p for _, a, b in rows for p in range(a, b)]], device=dev)
            seg = torch.tensor([0] + [b - a for _, a, b in rows], device=dev).cumsum(0)
            ctx = self.model.make_varlen_context(slots, positions, seg)
        self.model(ids, ctx, self.kv)
        for s, _, b in rows:
            self.cached[s.slot] = b

    def draft(self, i: int, cur: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, ctx) -> torch.Tensor:
        """Draft i in the step: logits [B, V] at position N-1+i."""
        return self.model.logits(self.model(cur, ctx(pos0[:, None] + i, i), self.kv)[:, -1])

    def done(self, seqs: list[Sequence], accepted: list[int], width: int) -> None:
        """After verification (before the append): the cache holds the last token and the accepted
        drafts it was fed (the step fed positions N-1 .. N-2+width)."""
        for s, a in zip(seqs, accepted):
            self.cached[s.slot] = min(s.num_tokens + a, s.num_tokens - 1 + width)
