"""SlotSampling: per-slot sampling parameters and penalty state, allocated once, indexed by slot."""
from __future__ import annotations

import torch

from ..request import MAX_LOGIT_BIAS
from .sampler import SamplingBatch
from .scheduler import Sequence


class SlotSampling:
    """Temperature, top-k/p, min-p, seed and penalties of every slot, written on admission."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device):
        S, V = max_slots, vocab_size
        self.device = device
        self.temperature = torch.ones(S, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(S, dtype=torch.int64, device=device)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(S, dtype=torch.float32, device=device)
        self.greedy = torch.ones(S, dtype=torch.bool, device=device)
        self.seed = torch.zeros(S, dtype=torch.int64, device=device)
        # penalties: [slots] parameters, [slots, V] output-token counts and prompt+output presence
        self.rep_penalty = torch.ones(S, dtype=torch.float32, device=device)
        self.presence = torch.zeros(S, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(S, dtype=torch.float32, device=device)
        self.counts = torch.zeros(S, V, dtype=torch.int32, device=device)
        self.seen = torch.zeros(S, V, dtype=torch.bool, device=device)
        self.penalized: set[int] = set()  # slots whose requests use a penalty
        # logit bias: [slots, MAX_LOGIT_BIAS] token ids and values (unused entries: token 0, +0.0)
        self.bias_ids = torch.zeros(S, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
        self.bias_vals = torch.zeros(S, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.biased: set[int] = set()  # slots whose requests have a logit_bias
        self.flags: dict[int, tuple[bool, bool]] = {}  # slot -> (greedy, uses top-k/top-p/min-p)

    def admit(self, slot: int, seq: Sequence) -> None:
        """Write a newly admitted sequence's sampling parameters into its slot row."""
        p = seq.params
        self.temperature[slot] = p.temperature if p.temperature > 0 else 1.0
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.greedy[slot] = p.greedy
        self.seed[slot] = seq.seed - 2**64 if seq.seed >= 2**63 else seq.seed  # uint64 bits as int64
        self.flags[slot] = (p.greedy, p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0.0)
        self.rep_penalty[slot] = p.repetition_penalty  # neutral values for unpenalized requests
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.penalized.discard(slot)
        self._clear_bias(slot)
        if p.logit_bias:
            n = len(p.logit_bias)
            self.bias_ids[slot, :n] = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            self.bias_vals[slot, :n] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            self.biased.add(slot)
        if p.penalized:
            self.penalized.add(slot)
            self.counts[slot].zero_()
            self.seen[slot].zero_()
            self.seen[slot, torch.tensor(seq.prompt_ids, device=self.device)] = True

    def free(self, slot: int) -> None:
        self.penalized.discard(slot)
        self._clear_bias(slot)
        self.flags.pop(slot, None)

    def _clear_bias(self, slot: int) -> None:
        # NOTE: a step with any biased row adds every row's table: an unbiased slot's must be zeros
        if slot in self.biased:
            self.bias_ids[slot].zero_()
            self.bias_vals[slot].zero_()
            self.biased.discard(slot)

    def kind(self, slots: list[int]) -> tuple[bool, bool]:
        """(every row greedy, a sampled row uses top-k / top-p / min-p): host facts of a batch."""
        flags = [self.flags.get(s, (True, False)) for s in slots]
        return all(g for g, _ in flags), any(f for g, f in flags if not g)

    def batch(self, rows: torch.Tensor, counter: torch.Tensor, greedy: bool, truncated: bool) -> SamplingBatch:
        """Sampling parameters of slot rows `rows` [R] (a slot may repeat) at output indices `counter` [R]."""
        return SamplingBatch(temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
                             min_p=self.min_p[rows],
                             greedy=self.greedy[rows], seed=self.seed[rows], counter=counter,
                             all_greedy=greedy, any_truncation=truncated)

    def penalize(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Repetition (divide positive / multiply negative logits of seen tokens), presence and
        frequency penalties on logits [B, V]; rows of unpenalized slots have neutral parameters."""
        rp = self.rep_penalty[slots][:, None]
        counts = self.counts[slots].float()  # [B, V]
        scaled = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(self.seen[slots], scaled, logits)
        return logits - counts * self.frequency[slots][:, None] - (counts > 0).float() * self.presence[slots][:, None]

    def add_bias(self, logits: torch.Tensor, slots: torch.Tensor) -> None:
        """logits [B, T, V] += each row's slot's logit bias at every position, in place (capturable)."""
        B, T, _ = logits.shape
        ids, vals = self.bias_ids[slots][:, None, :], self.bias_vals[slots][:, None, :]  # [B, 1, M]
        logits.scatter_add_(-1, ids.expand(B, T, -1), vals.expand(B, T, -1))

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record emitted tokens [B] of slots [B] for the penalties."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen[slots, tokens] = True
