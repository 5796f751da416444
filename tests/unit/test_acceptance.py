"""Verification emits the target's own tokens: a seeded sampled row gives the speculation-off
tokens whatever its drafts, the target distribution is kept, a draft d is accepted with
probability p(d); greedy rows accept the argmax prefix."""
from __future__ import annotations

import random

import dataclasses

import torch

from specguide.engine.sampler import sample
from specguide.speculative.acceptance import accept
from specguide.speculative.ngram import NgramDrafter

from test_sampling import batch  # (tests/unit is on sys.path: pytest prepends a package-less test folder)

CHI2_P001 = {5: 20.5, 4: 18.5, 3: 16.3}  # chi-square critical values at p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs.double() * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token outside the support was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def sampled(N: int, counter: torch.Tensor, seeds: torch.Tensor):
    return dataclasses.replace(batch(N, counter=counter), seed=seeds)


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor, start: int = 0):
    """As StepCore.tail: the seeded sample at each verified position, then accept."""
    N, T, V = logits.shape
    cnt = (start + torch.arange(T)).repeat(N)
    target = sample(logits.reshape(N * T, V), sampled(N * T, cnt, seeds.repeat_interleave(T))).view(N, T)
    return accept(target, drafts, torch.full((N,), T - 1))


def test_a_seeded_row_emits_the_speculation_off_tokens_whatever_its_drafts():
    """Position i's token is `sample` at output index start + i with the row's seed: the token a step
    without drafts emits there. So drafts (good, bad, none) change how many tokens a step emits,
    never which: a seeded request's output does not depend on K, the drafter or cost_aware_k."""
    g = torch.Generator().manual_seed(0)
    N, T, V = 2000, 4, 12
    logits = torch.randn(N, T, V, generator=g)
    seeds = torch.randint(0, 2**62, (N,), generator=g)
    off = torch.stack([sample(logits[:, i], sampled(N, torch.full((N,), 5 + i), seeds)) for i in range(T)], 1)
    for drafts in (off[:, :3], torch.randint(0, V, (N, 3), generator=g), torch.where(torch.arange(3) < 1, off[:, :3], -1)):
        acc, nxt = verify_sampled(logits, drafts, seeds, start=5)
        emitted = torch.cat([drafts, nxt[:, None]], 1).scatter(1, acc.long()[:, None], nxt[:, None])
        for r in range(N):
            a = int(acc[r])
            assert emitted[r, : a + 1].tolist() == off[r, : a + 1].tolist()
    acc, _ = verify_sampled(logits, off[:, :3], seeds, start=5)
    assert bool((acc == 3).all())  # drafts equal to the samples: all accepted


def test_one_hot_drafts_keep_the_masked_target_distribution_and_are_accepted_with_p_d():
    # target masked by a grammar: token 4 disallowed (probability 0 after masking)
    logits = torch.tensor([1.0, 0.5, 0.2, -0.3, float("-inf"), 0.8])
    p0 = logits.softmax(-1)
    N = 50000
    for d in (0, 2, 4):  # a likely, an unlikely and a grammar-invalid draft
        seeds = torch.arange(N) * 7919 + d
        acc, nxt = verify_sampled(logits.expand(N, 3, 6).contiguous(), torch.full((N, 2), d), seeds)
        first = torch.where(acc >= 1, torch.full_like(nxt, d), nxt)
        assert chi2(torch.bincount(first, minlength=6).double(), p0) < CHI2_P001[4]
        assert abs(acc.clamp(max=1).float().mean().item() - p0[d].item()) < 0.01


def test_second_token_after_an_accepted_draft_follows_its_own_distribution():
    p_pos0 = torch.tensor([0.6, 0.4, 0.0, 0.0])
    p_pos1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    N = 40000
    logits = torch.stack([p_pos0, p_pos1, p_pos1]).log().expand(N, 3, 4).contiguous()
    acc, nxt = verify_sampled(logits, torch.tensor([[0, 3]]).expand(N, 2).contiguous(), torch.arange(N) + 3)
    second = torch.where(acc >= 2, torch.full_like(nxt, 3), nxt)[acc >= 1]
    assert chi2(torch.bincount(second, minlength=4).double(), p_pos1) < CHI2_P001[3]


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    target = torch.tensor([[3, 5, 7, 1], [2, 2, 2, 2], [9, 0, 0, 0]])  # argmax at positions 0..3
    drafts = torch.tensor([[3, 5, 6], [2, 2, 2], [1, 0, 0]])
    acc, nxt = accept(target, drafts, torch.tensor([3, 2, 3]))
    assert acc.tolist() == [2, 2, 0]  # row 1: only 2 valid drafts, then the bonus
    assert nxt.tolist() == [7, 2, 9]


def test_ngram_drafter_proposes_the_latest_continuation():
    d = NgramDrafter(max_ngram=3)
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert d.propose(toks, 2) == [5, 6]  # latest earlier "1 2 3" is followed by 5 6
    assert d.propose([7, 8, 9], 3) == []
    assert d.propose(toks, 0) == []


def scan_match(tokens, k, max_ngram=4, min_ngram=1):
    """NgramDrafter.match as a plain scan of the history (its definition)."""
    if k <= 0:
        return [], 0
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        for start in range(n - size - 1, -1, -1):
            if tokens[start: start + size] == tokens[n - size:]:
                return tokens[start + size: start + size + k], size
    return [], 0


def test_ngram_match_is_the_scans_answer_byte_coincidences_included():
    # ids whose int32 bytes overlap when misaligned (1 << 8, 1 << 16, 1 << 24, 257, ...): a byte
    # search that took a match across token boundaries would answer differently
    g = random.Random(0)
    alphabet = [0, 1, 2, 256, 257, 65536, 65537, 16777216, 16843009, 49151]
    d = NgramDrafter()
    answered = 0
    for _ in range(3000):
        toks = [g.choice(alphabet[: g.randint(2, len(alphabet))]) for _ in range(g.randint(1, 40))]
        k = g.randint(0, 5)
        want = scan_match(toks, k)
        assert d.match(toks, k) == want, toks
        answered += bool(want[1])
    assert answered > 1000  # most histories recur
