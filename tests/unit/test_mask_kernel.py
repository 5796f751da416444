"""The C grammar-mask loop (kernels.mask_logits_rows) writes exactly what the torch path does."""
from __future__ import annotations

import pytest
import torch

from specguide import kernels
from specguide.guided.decoder import _BITS, mask_logits, mask_rows


def torch_masked(logits, words, token_mask, rows, vocab, d2t=None):
    out = logits.clone()
    mask_logits(out, words.index_select(0, rows), token_mask.index_select(0, rows), vocab, _BITS, d2t)
    return out


def c_masked(logits, words, token_mask, rows, vocab, d2t=None):
    out = logits.clone()
    assert kernels.mask_logits_rows(out, words, token_mask, rows, vocab, d2t)
    return out


@pytest.fixture
def masks():
    g = torch.Generator().manual_seed(0)
    N, vocab = 12, 1000  # 12 mask rows over a 1000-token vocabulary (32 words, the last one partial)
    W = (vocab + 31) // 32
    words = torch.randint(-2**31, 2**31 - 1, (N, W), dtype=torch.int32, generator=g)
    words[1] = -1  # every token allowed
    words[2] = 0  # none
    words[3, ::2] = 0  # whole words banned, whole words allowed
    words[3, 1::2] = -1
    token_mask = (torch.arange(N) % 5 != 4).to(torch.int32)  # rows 4 and 9 hold no mask
    return words, token_mask, vocab


@pytest.mark.parametrize("width", [1000, 1024])  # logits as wide as the vocabulary, and padded past it
def test_the_c_loop_masks_as_the_torch_path(masks, width):
    words, token_mask, vocab = masks
    rows = torch.tensor([3, 0, 4, 1, 2, 9, 11, 3])  # any rows, in any order, repeated
    logits = torch.randn(len(rows), width, generator=torch.Generator().manual_seed(1))
    logits[0, :5] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1e30])
    want = torch_masked(logits, words, token_mask, rows, vocab)
    got = c_masked(logits, words, token_mask, rows, vocab)
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2]) and torch.equal(got[3], logits[3][:width].where(
        torch.arange(width) < vocab, torch.tensor(float("-inf"))))  # unconstrained / all-allowed rows
    assert torch.isinf(got[4][:vocab]).all()  # a row that bans every token


def test_the_c_loop_masks_a_pruned_draft_vocabulary_as_the_torch_path(masks):
    words, token_mask, vocab = masks
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:300]  # draft id -> token id
    rows = torch.tensor([0, 5, 3, 9])
    logits = torch.randn(len(rows), 300, generator=torch.Generator().manual_seed(3))
    want = torch_masked(logits, words, token_mask, rows, vocab, d2t)
    got = c_masked(logits, words, token_mask, rows, vocab, d2t)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


def test_layouts_the_loop_does_not_take_fall_back_to_torch(masks):
    words, token_mask, vocab = masks
    rows = torch.tensor([0])
    for logits, w, tm in ((torch.randn(1, vocab, dtype=torch.float64), words, token_mask),
                          (torch.randn(1, 2 * vocab)[:, ::2], words, token_mask),  # not contiguous
                          (torch.randn(1, vocab), words, token_mask.bool())):
        before = logits.clone()
        assert not kernels.mask_logits_rows(logits, w, tm, rows, vocab)
        assert torch.equal(logits, before)
        mask_rows(logits, w, tm, rows, vocab, _BITS)  # the step's entry point: torch masks them
        assert torch.equal(logits, torch_masked(before, w, tm, rows, vocab)) and not torch.equal(logits, before)
