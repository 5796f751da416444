"""Rejection sampling keeps the (masked) target distribution; greedy rows reduce to argmax."""
from __future__ import annotations

import torch

from specguide.speculative.acceptance import uniforms, verify
from specguide.speculative.ngram import NgramDrafter

CHI2_P001 = {5: 20.5, 4: 18.5, 3: 16.3}  # chi-square critical values at p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs.double() * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token outside the support was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def _first_token(p, drafts, q=None, seed=0):
    N, T, V = p.shape
    g = torch.Generator().manual_seed(seed)
    ua = torch.rand(N, T - 1, generator=g)
    ur = torch.rand(N, T, V, generator=g).clamp(1e-7, 1 - 1e-7)
    acc, nxt = verify(p, drafts, torch.full((N,), T - 1), ua, ur, q)
    return torch.where(acc >= 1, drafts[:, 0], nxt), acc, nxt


def test_one_hot_drafts_keep_the_masked_target_distribution():
    # target masked by a grammar: token 4 disallowed (probability 0 after masking)
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3, float("-inf"), 0.8])
    p0 = logits.softmax(-1)
    N = 50000
    p = p0.expand(N, 3, 6).contiguous()
    for d in (0, 2, 4):  # a likely, an unlikely and a grammar-invalid draft
        first, acc, _ = _first_token(p, torch.full((N, 2), d), seed=d)
        assert chi2(torch.bincount(first, minlength=6).double(), p0) < CHI2_P001[4]
        assert abs(acc.clamp(max=1).float().mean().item() - p0[d].item()) < 0.01


def test_draft_distribution_q_keeps_the_target_distribution():
    p0 = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1, 0.0])
    q0 = torch.tensor([0.05, 0.1, 0.5, 0.05, 0.1, 0.2])  # proposes a token the target never emits
    N = 50000
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q0.expand(N, 6), 2, replacement=True, generator=g)
    first, _, _ = _first_token(p0.expand(N, 3, 6).contiguous(), drafts, q0.expand(N, 2, 6).contiguous(), seed=7)
    assert chi2(torch.bincount(first, minlength=6).double(), p0) < CHI2_P001[4]


def test_second_token_after_an_accepted_draft_follows_its_own_distribution():
    p_pos0 = torch.tensor([0.6, 0.4, 0.0, 0.0])
    p_pos1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    N = 40000
    p = torch.stack([p_pos0, p_pos1, p_pos1]).expand(N, 3, 4).contiguous()
    drafts = torch.tensor([[0, 3]]).expand(N, 2).contiguous()
    _, acc, nxt = _first_token(p, drafts, seed=3)
    second = torch.where(acc >= 2, torch.full_like(nxt, 3), nxt)[acc >= 1]
    assert chi2(torch.bincount(second, minlength=4).double(), p_pos1) < CHI2_P001[3]


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    V = 10
    target = torch.tensor([[3, 5, 7, 1], [2, 2, 2, 2], [9, 0, 0, 0]])  # argmax at positions 0..3
    p = torch.zeros(3, 4, V).scatter_(-1, target[..., None], 1.0)
    drafts = torch.tensor([[3, 5, 6], [2, 2, 2], [1, 0, 0]])
    ua, ur = uniforms(torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9]), 3, V)
    acc, nxt = verify(p, drafts, torch.tensor([3, 2, 3]), ua, ur)
    assert acc.tolist() == [2, 2, 0]  # row 1: only 2 valid drafts, then the bonus
    assert nxt.tolist() == [7, 2, 9]


def test_ngram_drafter_proposes_the_latest_continuation():
    d = NgramDrafter(max_ngram=3)
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert d.propose(toks, 2) == [5, 6]  # latest earlier "1 2 3" is followed by 5 6
    assert d.propose([7, 8, 9], 3) == []
    assert d.propose(toks, 0) == []
