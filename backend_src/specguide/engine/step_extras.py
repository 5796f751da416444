"""StepExtras: the eager-only part of a step, for the rows that ask for it: raw generation logits,
log probabilities, stop-token / bad-word bans and penalties.

Steps with extras never run as CUDA graphs (their work depends on host lists). The tensors ride
along with the tokens; the host reads them in `deliver`, after the step's wait."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..request import PromptLogprob
from .sampler import log_probs
from .scheduler import Sequence
from .slot_params import SlotSampling

NEG_INF = float("-inf")


def bad_word_bans(seq: Sequence) -> list[int]:
    """The tokens banned at the sequence's next position: the last token of each bad word whose
    other tokens end its output (all of a one-token bad word's)."""
    out, n = seq.output_ids, len(seq.output_ids)
    return [w[-1] for w in seq.params.bad_words_ids if n >= len(w) - 1 and out[n - len(w) + 1:] == w[:-1]]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], start: int, n: int) -> list[PromptLogprob]:
    """A prefill chunk's raw logits [m, V] (prompt positions start..start+m-1) -> for each prompt token
    they predict (positions 1.. of the prompt: the last position predicts the first output, not a
    prompt token) its id, log p under log_softmax(logits) and the top n (vLLM's prompt_logprobs)."""
    m = min(logits.shape[0], len(prompt_ids) - 1 - start)
    if m <= 0:
        return []
    lp = logits[:m].float().log_softmax(dim=-1)
    ids = prompt_ids[start + 1: start + 1 + m]
    tok = lp.gather(-1, torch.tensor(ids, device=lp.device)[:, None])[:, 0].tolist()
    if n:
        top = lp.topk(n, dim=-1)
        vals, idx = top.values.tolist(), top.indices.tolist()
        tops = [list(zip(idx[j], vals[j])) for j in range(m)]
    else:
        tops = [[] for _ in range(m)]
    return [(t, v, tp) for t, v, tp in zip(ids, tok, tops)]


class StepExtras:
    """Per-token work of one eager step over `seqs` (batch row b = seqs[b])."""

    def __init__(self, seqs: list[Sequence], params: SlotSampling, is_guided: Callable[[int], bool]):
        self.seqs, self.params = seqs, params
        self.raw_idx = [b for b, s in enumerate(seqs) if s.params.return_generation_logits]
        self.lp_idx = [b for b, s in enumerate(seqs) if s.params.wants_logprobs]
        self.penalized = any(s.slot in params.penalized for s in seqs)
        self.bans = self._bans(seqs, is_guided)
        self.raw: Optional[torch.Tensor] = None
        self.lp: Optional[tuple[torch.Tensor, Optional[tuple]]] = None

    @staticmethod
    def _bans(seqs: list[Sequence], is_guided: Callable[[int], bool]) -> Optional[tuple[list[int], list[int]]]:
        """(rows, tokens) at -inf: stop tokens before min_tokens (unguided rows: the grammar decides
        where a guided output ends) and the last token of each matching bad word."""
        rows: list[int] = []
        toks: list[int] = []
        for r, seq in enumerate(seqs):
            if len(seq.output_ids) < seq.params.min_tokens and not is_guided(seq.slot):
                rows += [r] * len(seq.stop_ids)
                toks += list(seq.stop_ids)
            banned = bad_word_bans(seq)
            rows += [r] * len(banned)
            toks += banned
        return (rows, toks) if rows else None

    def before(self, logits: torch.Tensor) -> None:
        """logits [B, T, V] straight from the model: keep raw copies."""
        if self.raw_idx:
            self.raw = logits[torch.tensor(self.raw_idx, device=logits.device)]  # advanced indexing: a copy

    def process(self, first: torch.Tensor, slots: torch.Tensor) -> None:
        """Penalties and bans on position 0 logits [B, V] in place (rows with extras never speculate)."""
        if self.penalized:
            first.copy_(self.params.penalize(first, slots))
        if self.bans is not None:
            rows, toks = self.bans
            first[torch.tensor(rows), torch.tensor(toks)] = NEG_INF

    def after(self, logits: torch.Tensor, slots: torch.Tensor, emitted: torch.Tensor, nxt: torch.Tensor) -> None:
        """Log probabilities of the emitted tokens [B, T] from the processed logits [B, T, V] (the
        distribution each token is drawn from, drafts or not); penalty counts of the drawn token."""
        if self.lp_idx:
            sel = torch.tensor(self.lp_idx, device=logits.device)
            lg = logits[sel]
            n, T, V = lg.shape
            rows = slots[sel].repeat_interleave(T)
            greedy, truncated = self.params.kind([self.seqs[b].slot for b in self.lp_idx])
            lp = log_probs(lg.reshape(n * T, V), self.params.batch(rows, torch.zeros_like(rows), greedy, truncated))
            lp = lp.view(n, T, V)
            tok = lp.gather(-1, emitted[sel].clamp_min(0)[..., None])[..., 0]
            N = max(self.seqs[b].params.top_logprobs for b in self.lp_idx)
            self.lp = (tok, lp.topk(N, dim=-1) if N else None)
        if self.penalized:
            self.params.count(slots, nxt)

    def deliver(self, counts: list[int]) -> None:
        """Leave the per-token outputs of each asking sequence's first counts[b] emitted tokens in
        its `out.step_*` fields (the engine keeps those of the tokens it appends)."""
        seqs = self.seqs
        if self.lp is not None:
            tok, top = self.lp
            tok = tok.tolist()
            vals, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
            for i, b in enumerate(self.lp_idx):
                seq, n, N = seqs[b], counts[b], seqs[b].params.top_logprobs
                seq.out.step_logprobs = tok[i][:n]
                seq.out.step_top_logprobs = [list(zip(ids[i][j][:N], vals[i][j][:N])) for j in range(n)] if N else None
        if self.raw is not None:
            for i, b in enumerate(self.raw_idx):
                seqs[b].out.step_logits = self.raw[i, :counts[b]].to("cpu", torch.float32)
