"""Batched sampler: the right distribution, top-k/top-p support, counter-based reproducibility."""
from __future__ import annotations

import math

import torch

from specguide.engine.sampler import SamplingBatch, filter_logits, sample, uniform


def batch(B, temperature=1.0, top_k=0, top_p=1.0, greedy=False, seed=0, counter=None, min_p=0.0):
    return SamplingBatch(
        temperature=torch.full((B,), float(temperature)), top_k=torch.full((B,), top_k, dtype=torch.int64),
        top_p=torch.full((B,), float(top_p)), min_p=torch.full((B,), float(min_p)), greedy=torch.full((B,), greedy),
        seed=torch.full((B,), seed, dtype=torch.int64),
        counter=torch.arange(B) if counter is None else counter,
        all_greedy=greedy, any_truncation=top_k > 1 or top_p < 1.0 or min_p > 0.0)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    keep = exp > 0
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


def test_uniforms_are_uniform_and_keyed():
    u = uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 20000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform(torch.tensor([5]), torch.tensor([0]), 20000)[0])


def test_a_uniform_never_rounds_to_one():
    """Seed 8, counter 12 draws a value that float32 rounds to 1.0 at ids 0 and 9526 (found by the
    step-core test: a greedy row in a sampled batch emitted 9526). A uniform of 1 made the Gumbel
    noise infinite: a masked token won."""
    u = uniform(torch.tensor([8]), torch.tensor([12]), 49152)
    assert u.max() < 1 and u.min() > 0
    logits = torch.full((1, 49152), float("-inf"))
    logits[0, 5] = 0.0  # the grammar allows one token
    assert sample(logits, batch(1, seed=8, counter=torch.tensor([12]))).tolist() == [5]


def test_samples_follow_softmax_with_temperature():
    # 8 tokens, 40k independent draws (distinct counters): chi-square with 7 dof, p=0.001 -> 24.3
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    N = 40000
    b = batch(N, temperature=0.7, seed=11)
    toks = sample(logits.expand(N, -1).contiguous(), b)
    counts = torch.bincount(toks, minlength=8).double()
    assert chi_square(counts, torch.softmax(logits / 0.7, -1).double()) < 24.3


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0, -2.0])
    N = 20000
    toks = sample(logits.expand(N, -1).contiguous(), batch(N, top_k=2, seed=1))
    assert set(toks.tolist()) == {0, 1}
    p = torch.softmax(logits, -1)
    top_p = float(p[:3].sum()) - 1e-4  # needs exactly the top 3 tokens
    b = batch(N, top_p=top_p, seed=2)
    toks = sample(logits.expand(N, -1).contiguous(), b)
    assert set(toks.tolist()) == {0, 1, 2}
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:3] = p[:3] / p[:3].sum()
    assert chi_square(torch.bincount(toks, minlength=6).double(), expected) < 13.8  # 2 dof
    assert torch.allclose(filter_logits(logits[None], batch(1, top_p=top_p)).softmax(-1)[0].double(), expected, atol=1e-6)


def test_min_p_keeps_tokens_within_its_share_of_the_likeliest():
    """min_p 0.3 at temperature 0.5: tokens whose probability (after temperature) is at least 0.3 x
    the top one's, renormalized; then top-p over what min-p kept (vLLM's order)."""
    logits = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.0, -3.0])
    p = torch.softmax(logits / 0.5, -1)
    keep = p >= 0.3 * p.max()
    assert keep.tolist() == [True, True, True, False, False, False]
    expected = torch.where(keep, p, 0).double()
    expected /= expected.sum()
    N = 20000
    toks = sample(logits.expand(N, -1).contiguous(), batch(N, temperature=0.5, min_p=0.3, seed=4))
    assert set(toks.tolist()) == {0, 1, 2}
    assert chi_square(torch.bincount(toks, minlength=6).double(), expected) < 13.8  # 2 dof
    got = filter_logits(logits[None], batch(1, temperature=0.5, min_p=0.3)).softmax(-1)[0].double()
    assert torch.allclose(got, expected, atol=1e-6)
    # min_p 1: the likeliest token alone
    assert torch.equal(filter_logits(logits[None], batch(1, min_p=1.0)).isfinite()[0], torch.arange(6) == 0)
    # then top-p over the mass min-p kept: the first two hold 0.797 of it (0.735 of the whole), so
    # top_p 0.76 keeps two tokens (top-p before min-p would keep three)
    assert float(expected[:2].sum()) > 0.76 > float(p[:2].sum())
    assert filter_logits(logits[None], batch(1, temperature=0.5, min_p=0.3, top_p=0.76)).isfinite()[0].tolist() == \
        [True, True, False, False, False, False]
    # a row whose grammar allows one token keeps it, whatever min_p is
    masked = torch.full((1, 6), float("-inf"))
    masked[0, 4] = -7.0
    assert sample(masked, batch(1, min_p=0.9)).tolist() == [4]


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    b = batch(6, temperature=5.0, seed=3)
    b.greedy = torch.tensor([True, False, True, False, True, False])
    toks = sample(logits, b)
    assert torch.equal(toks[b.greedy], logits.argmax(-1)[b.greedy])
    assert not math.isnan(float(toks.sum()))


def test_sampling_depends_only_on_seed_and_counter():
    logits = torch.randn(1, 1000)
    one = sample(logits, batch(1, seed=42, counter=torch.tensor([9])))
    many = batch(4, seed=0, counter=torch.tensor([9, 9, 1, 9]))
    many.seed = torch.tensor([1, 42, 42, 3])
    assert sample(logits.expand(4, -1).contiguous(), many)[1] == one[0]
